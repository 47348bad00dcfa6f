"""What a run writes about itself: logging, trackers, the metrics record and summary, the report, the model
card and Hub upload, the output-dir lock, export."""

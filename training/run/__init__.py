"""The run's directory and what it records there: config.yaml, the run lock, loggers, the profiler, object storage."""

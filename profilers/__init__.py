from profilers.scheduled import ScheduledProfiler

__all__ = ["ScheduledProfiler"]

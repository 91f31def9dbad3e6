"""The heartbeat: each process hears the others, and a lost or failed peer stops the job with one paragraph."""

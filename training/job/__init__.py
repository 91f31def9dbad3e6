"""A distributed job's start-up and what its processes agree on: the handshake, the job's store, elastic node counts."""

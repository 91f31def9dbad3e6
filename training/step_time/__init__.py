"""Where each training step's time goes on every node (data, compute, collectives), which node holds the job back,
and what scaling paid."""

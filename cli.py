"""Train, validate, test or predict any LightningModule / LightningDataModule chosen by ``class_path``:

    python cli.py fit -c configs/ddp.yaml                   # one node: every visible GPU, or 2 CPU processes
    ./scripts/run_ddp_train.sh 0,1,2,3 NODE_RANK            # one node of several (docs/multi-node.md)

Every behaviour of a run is declared in configs/ddp.yaml; this file builds the CLI and reports a config mistake.
"""

import atexit
import gc
import os
import sys

from training.job import versions
from training.job.early import take_stop_signals

if __name__ == "__main__":  # a stop during the seconds of the imports below ends in a paragraph too, not a traceback
    take_stop_signals()
    versions.check()  # before the imports: a release the template does not support would fail in them, or later
    # torch reads it as it is imported. A heartbeat's store call cut off as global rank 0's process ends would print
    # a C++ warning with its backtrace before the paragraph that explains the stop; DEBUG=1 on the launcher (or a
    # value of your own) keeps torch's C++ warnings.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

# Importing torch and Lightning makes over 300,000 objects and next to no garbage: the collections that ran while
# they were made, and again at exit over all of them, took over a second of CPU in every process.
gc.disable()

from training.config.cli import CLI, main  # noqa: E402

# What the imports made lives as long as the process: collections skip it from here on, and the DataLoader workers
# forked from this process share its memory pages instead of copying each one the collector would touch.
gc.freeze()
gc.enable()


def unfreeze_for_nanobind(modules: dict = sys.modules) -> None:
    """At exit, hand what the imports made back to the collector where an extension built with nanobind is loaded
    (triton's, beside torch 2.15's CUDA build): nanobind prints some 25 lines of "leaked" objects at exit for each of
    its objects still alive, and frozen ones never die. The final collection this brings back costs those processes
    alone under a second of CPU."""
    for module in list(modules.values()):
        if str(getattr(module, "__file__", None)).endswith(".so") and "nb_func" in {
            type(value).__name__ for value in vars(module).values()
        }:
            gc.unfreeze()
            return


atexit.register(unfreeze_for_nanobind)

__all__ = ["CLI", "main"]

if __name__ == "__main__":
    main()

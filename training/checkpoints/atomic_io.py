"""Checkpoints written to a temporary file beside their destination and renamed into place, in the background if
asked, and removed only from the directory the run saves into."""

import errno
import io
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection

from training.checkpoints.contents import size_text, unloadable
from training.run.storage import parent


class CheckpointSpaceError(OSError):
    """A checkpoint the disk had no room for; its message is the paragraph that says so."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Saves local checkpoints atomically: a process killed mid-save leaves the previous checkpoint intact.

    The checkpoint is streamed to ``.<name>.partial`` in the destination directory, synced to disk, then
    renamed over the destination. Lightning's own save goes through a temporary file in the system temp
    directory, which becomes a non-atomic copy when that is another filesystem (a mounted volume, say).
    A save that fails (a full disk) removes its ``.partial`` file; those a kill left behind are removed before the
    first save into their directory. An object store
    (``s3://``) shows an object only once its upload is complete, which is atomic already.

    With ``background``, a save copies the checkpoint's tensors into host memory and returns: a thread writes
    the copy while training goes on. Removals (ModelCheckpoint's previous best, right after it asked for the new
    save) wait in the same queue, and are skipped when a write before them failed: neither a kill nor a full disk
    leaves the old file removed and the new one unwritten. Before
    the copy of a later step, the writes of earlier steps are awaited (an error of a write is raised there) and
    their copies' memory is used again: host memory holds the copies of one step's checkpoints (the best and the
    last: twice the state) while the run trains. Loading and the end of the run (``teardown``, also after an
    exception or a stop signal) wait for every write.

    It removes no checkpoint the run resumed from, and none outside the directory it last saved into. Lightning
    2.6.6 guards against both for local paths only (Lightning #21813): in an object store, a run resumed from its
    best checkpoint deleted that file once it saved a better one, and with ``monitor=None`` a run started from
    another run's checkpoint deleted that one at its first save.

    The first checkpoint a process writes to a local disk is loaded back as the run loads checkpoints: where
    ``torch.load(weights_only=True)`` refuses an object in it (a numpy array a module keeps), a warning names the
    object's type, where it sits and the fixes at once, not when a resume, hours later, cannot read any of them.

    Args:
        background: write checkpoints in a background thread.
        weights_only: how the run loads checkpoints (the config's top-level ``weights_only``; None: torch's
            default, True); False: the first checkpoint is not loaded back.
    """

    def __init__(self, background: bool = False, weights_only: bool | None = None) -> None:
        super().__init__()
        self.background = background
        self.unchecked = weights_only is not False
        self.loaded: str | None = None
        self.saving_into: str | None = None
        self.executor: ThreadPoolExecutor | None = None
        self.pending: list[tuple[int, Future, list[torch.Tensor]]] = []  # (global step, write or removal, its copies)
        self.spare: dict[tuple, list[torch.Tensor]] = {}  # host memory of written copies, by shape and dtype
        self.step = 0  # of the newest checkpoint asked for
        self.cleaned: set[Path] = set()  # directories rid of the .partial files an earlier attempt left

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        if not self.background:
            self.write(checkpoint, str(path))
            return
        self.step = checkpoint.get("global_step", self.step)
        self.wait(before_step=self.step)
        copies: list[torch.Tensor] = []

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            # Into the memory of an earlier, written copy where there is one: first writes to fresh memory cost
            # more than the copy itself.
            spare = self.spare.get((tensor.shape, tensor.dtype))
            copied = (spare.pop() if spare else torch.empty(tensor.shape, dtype=tensor.dtype)).copy_(tensor.detach())
            copies.append(copied)
            return copied

        # The only time training waits: tensors the next steps change in place, copied to host memory.
        self.queue(self.write, apply_to_collection(checkpoint, torch.Tensor, copy), str(path), copies=copies)

    def write(self, checkpoint: dict[str, Any], path: str) -> None:
        self.saving_into = parent(path)
        if not isinstance(fs := get_filesystem(path), LocalFileSystem):
            upload(fs, checkpoint, path)
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.parent not in self.cleaned:  # before this process wrote any: only a kill's can be there
            self.cleaned.add(target.parent)
            for leftover in target.parent.glob(".*.ckpt.partial"):
                leftover.unlink(missing_ok=True)
        partial = target.with_name(f".{target.name}.partial")
        try:
            with open(partial, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
        except OSError as error:
            partial.unlink(missing_ok=True)  # nothing half-written left behind, and its space free again
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CheckpointSpaceError(no_room(checkpoint, target)) from None
            raise
        os.replace(partial, target)
        directory = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # make the rename itself survive a crash
        finally:
            os.close(directory)
        if self.unchecked:
            self.unchecked = False
            if problem := unloadable(checkpoint, target):
                rank_zero_warn(problem)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        if self.background:
            # ModelCheckpoint asks for this right after the save of its replacement: done only if that succeeded.
            earlier = [future for _, future, _ in self.pending]
            self.queue(self.remove_after, earlier, str(path), copies=[])
        else:
            self.remove(str(path))  # a failed save raised before Lightning could ask

    def remove_after(self, earlier: list[Future], path: str) -> None:
        if all(future.exception() is None for future in earlier):  # done: one writer thread, in order
            self.remove(path)

    def remove(self, path: str) -> None:
        if path == self.loaded or (self.saving_into is not None and parent(path) != self.saving_into):
            return
        super().remove_checkpoint(path)

    def load_checkpoint(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.wait()
        self.loaded = str(path)
        return super().load_checkpoint(path, *args, **kwargs)

    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            self.spare.clear()
            if self.executor is not None:
                self.executor.shutdown()
                self.executor = None

    def when_written(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once every checkpoint asked for so far is written (at once without background writes;
        never if a write fails)."""
        if not self.pending:
            callback()
            return
        self.pending[-1][1].add_done_callback(lambda future: future.exception() is None and callback())

    def queue(self, work: Any, *args: Any, copies: list[torch.Tensor]) -> None:
        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self.pending.append((self.step, self.executor.submit(work, *args), copies))

    def wait(self, before_step: int | None = None) -> None:
        """Wait for the queued writes and removals (of steps before ``before_step``); raise the first error."""
        waiting = [item for item in self.pending if before_step is None or item[0] < before_step]
        self.pending = [item for item in self.pending if before_step is not None and item[0] >= before_step]
        for _, future, copies in waiting:
            future.result()
            for copied in copies:  # written: its memory takes the next copy of a tensor of its shape
                self.spare.setdefault((copied.shape, copied.dtype), []).append(copied)


def upload(fs: AbstractFileSystem, checkpoint: dict[str, Any], path: str) -> None:
    """Write ``checkpoint`` to ``path`` in ``fs``, a remote store, as Lightning 2.6.6 does (``fs.pipe``: in parallel
    parts where the store takes them) but outside ``fs.transaction``, in which Lightning wraps it. fsspec shares an
    instance's transaction with every thread using the store: a file another thread opens meanwhile (TensorBoard's
    event writer appending to its events file) joins it, and the save's commit then finishes that file under its
    writer, which fails (s3fs: 'NoneType' object has no attribute 'getbuffer') or loses what it wrote. An object
    store shows an object only once its upload is complete: the save stays atomic without it."""
    data = io.BytesIO()
    torch.save(checkpoint, data)
    fs.makedirs(os.path.dirname(path), exist_ok=True)
    fs.pipe(path, data.getvalue())


def no_room(checkpoint: dict[str, Any], target: Path) -> str:
    """The paragraph for ``checkpoint``, which did not fit on the disk of ``target``'s directory."""
    needed = written_size(checkpoint)
    disk = shutil.disk_usage(target.parent)
    return (
        f"the checkpoint {target} could not be saved: the disk of {target.parent} is full. The checkpoint needs "
        f"{size_text(needed)} and {size_text(disk.free)} of the disk's {size_text(disk.total)} is free; the "
        f"run's earlier checkpoints are kept whole. Free at least {size_text(max(needed - disk.free, 1))} there (more "
        "for the checkpoints still to come), or give the run a larger disk, then run the same command: it resumes "
        "from the run's last.ckpt."
    )


class ByteCounter:
    """A file that counts what is written to it."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: Any) -> int:
        self.size += memoryview(data).nbytes
        return memoryview(data).nbytes

    def flush(self) -> None:
        pass


def written_size(checkpoint: dict[str, Any]) -> int:
    counter = ByteCounter()
    torch.save(checkpoint, counter)
    return counter.size

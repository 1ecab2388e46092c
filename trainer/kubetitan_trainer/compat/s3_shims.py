"""Shims of s3torchconnector: the S3 client, its ranged reader, and DCP's S3 storage writer and reader (with the
DCP writer's thread errors raised)."""

from __future__ import annotations

from typing import Any

from kubetitan_trainer.compat.registry import Upstream, _rebind, _shim


# ====================================================================== S3 checkpoints (kubetitan_trainer.storage)
_S3FS = "s3torchconnector.dcp.s3_file_system"


@_shim(Upstream("s3torchconnector:S3ClientConfig",
                params=("throughput_target_gbps", "part_size", "unsigned", "force_path_style", "max_attempts",
                        "profile")))
def s3_client_config(settings) -> Any:
    """s3torchconnector's ``S3ClientConfig`` from :class:`kubetitan_trainer.storage.S3Settings`: path-style
    addressing, the client's retry attempts (its CRT standard retry strategy: exponential backoff with jitter
    on 503 SlowDown, 5xx, throttling, resets and timeouts), part size and throughput target."""
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(throughput_target_gbps=settings.throughput_target_gbps, part_size=settings.part_size_bytes,
                          force_path_style=settings.force_path_style, max_attempts=settings.max_attempts)


@_shim(Upstream("s3torchconnector._s3client._s3client:S3Client.__init__",
                params=("self", "region", "endpoint", "user_agent", "s3client_config")))
def s3_client(settings, config) -> Any:
    """An s3torchconnector ``S3Client`` for the settings' region and endpoint (an S3-compatible server's URL,
    or AWS's own when empty). The client class lives in the private ``s3torchconnector._s3client``; the public
    DCP writer and reader take a region but no endpoint, so a non-AWS endpoint needs this client."""
    from s3torchconnector._s3client import S3Client

    return S3Client(settings.region, endpoint=settings.endpoint or None, s3client_config=config)


@_shim(Upstream("s3torchconnector:S3ReaderConstructor.range_based", params=("buffer_size",)))
def s3_range_reader() -> Any:
    """s3torchconnector's range-based object reader without its own buffer (``buffer_size=0``): each ``readinto``
    after a ``seek`` is one ranged GET of exactly the bytes asked for (the staging of ``s3://`` shards reads parts
    of known size, :mod:`kubetitan_trainer.data.s3shards`)."""
    from s3torchconnector import S3ReaderConstructor

    return S3ReaderConstructor.range_based(buffer_size=0)


def _s3_file_system(settings, config, reader_constructor=None) -> Any:
    from s3torchconnector.dcp import S3FileSystem

    return S3FileSystem(settings.region, s3_client=s3_client(settings, config), reader_constructor=reader_constructor)


@_shim(Upstream(f"{_S3FS}:S3StorageWriter.__init__",
                params=("self", "region", "path", "s3client_config", "prefix_strategy", "thread_count", "kwargs"),
                sets=("fs", "path", "prefix_strategy")),
       Upstream(f"{_S3FS}:S3FileSystem.__init__",
                params=("self", "region", "s3_client", "s3client_config", "reader_constructor")))
def s3_storage_writer(checkpoint_id: str, settings, config) -> Any:
    """A DCP ``S3StorageWriter`` for ``checkpoint_id`` whose file system uses :func:`s3_client` (the endpoint).

    ``S3StorageWriter`` builds its ``S3FileSystem`` (attribute ``fs``) in ``__init__`` from a region and
    config only; the file system is replaced before any request is made (the client connects lazily).

    Its write errors are made the save's (:func:`_raise_stream_errors`)."""
    from s3torchconnector.dcp import S3StorageWriter

    w = S3StorageWriter(settings.region, checkpoint_id, s3client_config=config, thread_count=settings.thread_count)
    fs = _s3_file_system(settings, config)
    _rebind(w, "fs", fs)
    _rebind(w, "path", fs.init_path(checkpoint_id))
    _raise_stream_errors(w)
    return w


class _Discard:
    """A write stream that keeps nothing (:func:`_raise_stream_errors`: a file whose object could not be opened is
    written here, then the save fails with the open's error); ``tell`` is what DCP's writer records offsets with."""

    def __init__(self) -> None:
        self.position = 0

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self.position += n
        return n

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        """Nothing is buffered."""

    def close(self) -> None:
        """Nothing is held open."""


@_shim(Upstream("torch.distributed.checkpoint.filesystem:_write_files_from_queue",
                contains=('with create_stream(file_name, "wb") as stream:', "result_queue.put(write_results)")),
       Upstream("torch.distributed.checkpoint.filesystem:_FileSystemWriter._write_data",
                contains=("threading.Thread(", "target=_write_files_from_queue", "t.join()")),
       Upstream("torch.distributed.checkpoint.filesystem:_FileSystemWriter.write_data", params=("self", "plan", "planner")),
       Upstream(f"{_S3FS}:S3FileSystem.create_stream", params=("self", "path", "mode")))
def _raise_stream_errors(writer) -> None:
    """Make a failed object write fail the DCP save on this rank, whichever writer thread it happened in.

    DCP's filesystem writer writes files on ``thread_count`` threads (``_write_data``): the extra threads run
    ``_write_files_from_queue`` bare, so an S3 error there (an outage mid-save) escapes as a thread traceback on
    stderr and the save goes on without that file's write results, as if it had succeeded (only an error on the
    calling thread fails it). Here every stream's error is caught where ``create_stream`` is used (the thread
    moves on) and ``write_data`` raises the first one after the threads end, so DCP fails the save on every rank
    (``CheckpointException``) and nothing is printed."""
    import contextlib

    errors: list[BaseException] = []
    create_stream, write_data = writer.fs.create_stream, writer.write_data

    @contextlib.contextmanager
    def recording_create_stream(path, mode):
        entered = False
        try:
            with create_stream(path, mode) as stream:
                entered = True
                yield stream
        except Exception as e:  # noqa: BLE001 - kept for write_data, which raises it on the calling thread
            if mode != "wb":
                raise
            errors.append(e)
            if not entered:  # the object could not even be opened: the thread writes this file into nothing
                yield _Discard()

    def checked_write_data(plan, planner):
        errors.clear()
        result = write_data(plan, planner)
        if errors:
            raise errors[0]
        return result

    _rebind(writer.fs, "create_stream", recording_create_stream)
    _rebind(writer, "write_data", checked_write_data)


@_shim(Upstream(f"{_S3FS}:S3StorageReader.__init__",
                params=("self", "region", "path", "s3client_config", "reader_constructor"),
                sets=("fs", "path", "_reader_constructor")))
def s3_storage_reader(checkpoint_id: str, settings, config) -> Any:
    """A DCP ``S3StorageReader`` for ``checkpoint_id`` whose file system uses :func:`s3_client` (see
    :func:`s3_storage_writer`); the reader's own DCP-optimised ranged reader constructor is kept."""
    from s3torchconnector.dcp import S3StorageReader

    r = S3StorageReader(settings.region, checkpoint_id, s3client_config=config)
    fs = _s3_file_system(settings, config, reader_constructor=r._reader_constructor)
    _rebind(r, "fs", fs)
    _rebind(r, "path", fs.init_path(checkpoint_id))
    return r

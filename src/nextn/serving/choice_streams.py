"""Several choices' streams as one: the (job, piece) pairs of n choices, in the order they come."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

__all__ = ["merge_pieces"]


async def merge_pieces(pieces: Callable, jobs: list[Any]) -> AsyncIterator[tuple[Any, tuple]]:
    """(job, piece) from every job's `pieces(job)` stream as they come (n choices streamed together); an error in
    one ends the merged stream with it (the others are then aborted by their own streams' cleanup)."""
    if len(jobs) == 1:
        async for piece in pieces(jobs[0]):
            yield jobs[0], piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(job: Any) -> None:
        try:
            async for piece in pieces(job):
                await queue.put((job, piece, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((job, None, e))
        finally:
            await queue.put((job, None, StopAsyncIteration()))

    tasks = [asyncio.ensure_future(pump(j)) for j in jobs]
    try:
        open_ = len(jobs)
        while open_:
            job, piece, err = await queue.get()
            if isinstance(err, StopAsyncIteration):
                open_ -= 1
            elif err is not None:
                raise err
            else:
                yield job, piece
    finally:
        for t in tasks:
            t.cancel()

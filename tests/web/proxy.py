"""A TCP proxy in front of a server that a test can cut: every open connection is closed at once, as when a
network drops, while new connections still go through (or are refused while it is down)."""

from __future__ import annotations

import asyncio
import threading

from tests.servers import free_port


class CuttableProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port, self.port = target_port, free_port()
        self.accepted = 0  # connections accepted so far
        self.down = False  # refuse new connections (close them at once) while True
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cuttable-proxy", daemon=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> CuttableProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def cut(self) -> int:
        """Closes every open connection (both directions); returns how many there were."""
        return asyncio.run_coroutine_threadsafe(self._cut(), self._loop).result(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    async def _shutdown(self) -> None:
        self._server.close()
        await self._cut()
        others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def _cut(self) -> int:
        writers, self._writers = list(self._writers), set()
        for writer in writers:
            writer.transport.abort()  # a reset, not a polite close: the reader sees a network error
        return len(writers) // 2

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.down:
            client_writer.transport.abort()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_writer.transport.abort()
            return
        self._writers |= {client_writer, upstream_writer}
        await asyncio.gather(
            self._pipe(client_reader, upstream_writer),
            self._pipe(upstream_reader, client_writer),
            return_exceptions=True,
        )
        self._writers -= {client_writer, upstream_writer}

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

"""HTTP connections that cannot be held open by a client that never finishes a request's headers.

uvicorn times out a keep-alive connection only once a response is done; a new connection that sends nothing,
or sends its request line and headers a byte at a time (slowloris), is held as long as the client likes,
and enough of them exhaust the server's file descriptors. Here a request's headers must be complete within
`--header-timeout-s` of the connection opening, or of the first byte after the previous response; else the
connection is closed (nginx's client_header_timeout does the same, with a 408).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's headers (`header_timeout_s`; 0: none)."""

    header_timeout_s: float = 30.0
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self._header_deadline is None and self._between_requests():
            self._arm_header_deadline()  # the first bytes of the next request on this connection
        super().data_received(data)
        if not self._between_requests():  # its headers are in: the request runs as long as it needs
            self._disarm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_deadline(self) -> None:
        if self.header_timeout_s > 0:
            self._header_deadline = self.loop.call_later(self.header_timeout_s, self._header_deadline_passed)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self) -> None:
        self._header_deadline = None
        if self._between_requests() and not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers did not arrive within %g s",
                             self.header_timeout_s)
            self.transport.close()


def header_deadline_protocol(header_timeout_s: float) -> type[HeaderDeadlineH11]:
    """The protocol class for uvicorn.Config(http=...), with this deadline."""
    return type("HeaderDeadlineH11", (HeaderDeadlineH11,), {"header_timeout_s": header_timeout_s})

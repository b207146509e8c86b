#!/usr/bin/env python3
"""A TCP forwarder standing for "one Redis address that moves" (a cloud
primary endpoint, a Kubernetes Service, a TCP proxy), for bench/soak.sh.

    forwarder.py LISTEN_PORT CONTROL_PORT TARGET_PORT

Listens on 127.0.0.1:LISTEN_PORT and pipes each connection to
127.0.0.1:TARGET_PORT as it was when the connection was accepted: a
connection already open stays piped to the old target after a switch, as a
real endpoint's do, and only new connections reach the new one. When either
side closes, both are closed.

Control, one line per connection on 127.0.0.1:CONTROL_PORT:
    target PORT   new connections go to 127.0.0.1:PORT; answers "ok"
Prints "ready" on stdout once both ports listen.
"""

import asyncio
import sys


class Forwarder:
    def __init__(self, target_port):
        self.target_port = target_port

    async def pipe(self, reader, writer):
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def client(self, client_reader, client_writer):
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(
                "127.0.0.1", self.target_port)
        except OSError:
            # The target is down: refuse as it would (the client sees the
            # connection close and retries).
            client_writer.close()
            return
        await asyncio.gather(
            self.pipe(client_reader, upstream_writer),
            self.pipe(upstream_reader, client_writer),
        )

    async def control(self, reader, writer):
        line = (await reader.readline()).decode().split()
        if len(line) == 2 and line[0] == "target" and line[1].isdigit():
            self.target_port = int(line[1])
            print(f"forwarder: new connections go to port {self.target_port}",
                  file=sys.stderr, flush=True)
            writer.write(b"ok\n")
        else:
            writer.write(b"error: expected 'target PORT'\n")
        await writer.drain()
        writer.close()


async def main():
    if len(sys.argv) != 4 or not all(a.isdigit() for a in sys.argv[1:]):
        sys.exit("usage: forwarder.py LISTEN_PORT CONTROL_PORT TARGET_PORT")
    listen, control, target = (int(a) for a in sys.argv[1:])
    forwarder = Forwarder(target)
    servers = [
        await asyncio.start_server(forwarder.client, "127.0.0.1", listen),
        await asyncio.start_server(forwarder.control, "127.0.0.1", control),
    ]
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass

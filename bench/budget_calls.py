"""Calls of the budget function (lua/budget.lua) for bench/lua_instructions.sh:
each call carries BATCH reserves of 100 on new fixed-window keys (one check
each, as `ratekeeper-bench --mode budget` makes them) and the settles at 60
of the previous call's reservations, as ratekeeper's batcher joins Reserves
and Settles in flight together. Fails on an error reply or an answer that is
not granted / settled.

    python3 bench/budget_calls.py PORT FUNCTION CALLS BATCH FIRST_KEY
"""

import socket
import sys

FIELDS = "fw 1000000000 3600000 0 100 1 0"


def command(args):
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        arg = arg.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)


def read(f):
    line = f.readline()
    kind, rest = line[:1], line[1:-2]
    if kind == b"-" or not line:
        raise SystemExit(f"redis answered {line!r}")
    if kind == b":":
        return int(rest)
    if kind == b"*":
        return [read(f) for _ in range(int(rest))]
    raise SystemExit(f"unexpected reply {line!r}")


def answers(reply):
    """Each operation's answer, as the budget function frames them."""
    i = 0
    while i < len(reply):
        n = reply[i]
        yield reply[i + 1 : i + 1 + n]
        i += 1 + n


def main():
    port, function, calls, batch, first = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
    conn = socket.create_connection(("127.0.0.1", int(port)))
    f = conn.makefile("rb")
    pending = []
    for call in range(calls):
        keys, argv, made = [], [""], []
        for i in range(batch):
            n = first + call * batch + i
            tag = "rk:{bench_fw|user_id=k%d}" % n
            marker, counter = "%s:rsv.%032x" % (tag, n), tag + ":fw.3600"
            keys += [marker, counter]
            argv += ["reserve 1 300000", FIELDS]
            made.append((marker, counter))
        for marker, counter in pending:
            keys += [marker, counter]
            argv += ["settle 1 60"]
        conn.sendall(command(["FCALL", function, str(len(keys))] + keys + argv))
        for answer in answers(read(f)):
            if answer[0] != 1:
                raise SystemExit(f"an operation answered {answer}")
        pending = made


if __name__ == "__main__":
    main()

"""Calls of the budget function (lua/budget.lua) for bench/lua_instructions.sh:
each call carries BATCH reserves of 100 on new fixed-window keys (one check
each, as `ratekeeper-bench --mode budget` makes them) and the settles at 60
of the previous call's reservations (their times and marks from its answers,
each recorded in its second's bucket under its nonce), as ratekeeper's
batcher joins Reserves and Settles in flight together. Fails on an error
reply or an answer that is not granted / settled.

    python3 bench/budget_calls.py PORT FUNCTION CALLS BATCH FIRST_KEY
"""

import hashlib
import socket
import struct
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
    if kind == b"$":
        return unpack(f.read(int(rest) + 2)[:-2])
    raise SystemExit(f"unexpected reply {line!r}")


# MessagePack's integer forms (type byte -> struct format), as cmsgpack.pack
# writes the function's reply (src/store/packed.rs).
WIDE = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}


def unpack(data):
    """The integers of a packed reply (an array of integers)."""
    head, at = data[0], 1
    if 0x90 <= head <= 0x9F:
        count = head & 0x0F
    else:
        size = 2 if head == 0xDC else 4
        count = int.from_bytes(data[1 : 1 + size], "big")
        at += size
    out = []
    for _ in range(count):
        b, at = data[at], at + 1
        if b < 0x80 or b >= 0xE0:
            out.append(b if b < 0x80 else b - 256)
        else:
            fmt = WIDE[b]
            out.append(struct.unpack_from(fmt, data, at)[0])
            at += struct.calcsize(fmt)
    return out


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
            counter = "rk:{bench_fw|user_id=k%d}:fw.3600" % n
            nonce = hashlib.md5(b"%d" % n).hexdigest()
            keys.append(counter)
            argv += ["reserve 1 300000", FIELDS]
            made.append((nonce, counter))
        for (nonce, counter), (at, mark) in pending:
            expires = at + 300000
            keys += [counter, "rk:rsvb.%d.%s" % (expires // 1000, nonce[0])]
            argv += ["settle 1 60 %d 0" % expires, FIELDS, "%d %d" % (at, mark), nonce]
        conn.sendall(command(["FCALL", function, str(len(keys))] + keys + argv))
        taken = []
        for answer in answers(read(f)):
            if answer[0] != 1:
                raise SystemExit(f"an operation answered {answer}")
            if len(answer) == 6:  # a reserve's: granted, 3 fields, time, mark
                taken.append((answer[4], answer[5]))
        pending = list(zip(made, taken))

if __name__ == "__main__":
    main()

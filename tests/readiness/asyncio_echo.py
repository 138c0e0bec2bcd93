# The lost-readiness reproduction of issue 17: one asyncio process, an echo
# server and N clients that each send a random blob, half-close and read the
# echo back until EOF. Prints "ok N" when every client got its bytes back.
#   python3 asyncio_echo.py IP [CONNS] [BYTES]
import asyncio, os, sys

async def handle(r, w):
    while data := await r.read(65536):
        w.write(data)
        await w.drain()
    w.close()

async def client(ip, port, nbytes):
    r, w = await asyncio.open_connection(ip, port)
    blob = os.urandom(nbytes)
    w.write(blob)
    await w.drain()
    w.write_eof()
    got = bytearray()
    while chunk := await r.read(65536):
        got += chunk
    w.close()
    return bytes(got) == blob

async def main(ip, conns, nbytes):
    srv = await asyncio.start_server(handle, ip, 0)
    port = srv.sockets[0].getsockname()[1]
    ok = await asyncio.gather(*[client(ip, port, nbytes) for _ in range(conns)])
    srv.close()
    print("ok" if all(ok) else "MISMATCH", sum(ok), flush=True)
    return all(ok)

ip = sys.argv[1]
conns = int(sys.argv[2]) if len(sys.argv) > 2 else 50
nbytes = int(sys.argv[3]) if len(sys.argv) > 3 else 200_000
sys.exit(0 if asyncio.run(main(ip, conns, nbytes)) else 1)

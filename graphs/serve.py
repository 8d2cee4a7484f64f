"""graphs.export DIR --netron: the written graphs served in Netron, one address each, until Ctrl-C.

`netron.start` returns at once and its server threads end with the process, so this keeps the process up.
The netron package is imported only here, for --netron (the lab pins it; a plain install may lack it).
"""
import logging
import socket
import sys
import time

HOST = "localhost"
DEFAULT_PORT = 8080  # netron's own first choice


def check_netron():
    """ValueError (one line) unless the netron package can be imported: checked before anything is written."""
    try:
        import netron  # noqa: F401
    except ImportError:
        raise ValueError("--netron needs the netron package: ./lab_env/python has it; elsewhere pip install "
                         "netron") from None


def ports(first, count):
    """The ports the graphs are served at: `first` and the ones after it (0: each a free one the system picks)."""
    return [0] * count if first == 0 else list(range(first, first + count))


def check_ports(first, count, host=HOST):
    """ValueError (one line naming the port) unless every port that --port asks for can be listened on now:
    checked before the graphs are written, not after."""
    if not 0 <= first <= 65535 - count + 1:
        raise ValueError(f"--port must be 0 (free ports) or in [1, {65535 - count + 1}] ({count} graphs, one port "
                         f"each), got {first}")
    for port in ports(first, count):
        if port == 0:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as e:
                raise ValueError(f"--port: {host}:{port} cannot be listened on ({e.strerror}); --port 0 picks free "
                                 "ports") from None


def _own_handler(netron):
    """Give the next server netron starts a request handler class of its own. netron 9.3 sets the model a server
    serves on its handler *class*, which every server shares: seven graphs served in one process all served the
    last one. A subclass per server keeps each its own (a netron without that class is left as it is)."""
    server = getattr(netron, "server", None)
    handler = getattr(server, "_HTTPRequestHandler", None)
    if isinstance(handler, type):
        base = handler.__bases__[0] if handler.__name__ == "GraphHandler" else handler  # not one of ours
        server._HTTPRequestHandler = type("GraphHandler", (base,), {})


def serve(paths, first, out=sys.stdout, host=HOST):
    """Serve each model in `paths` in Netron at its own address, print one line per graph, and keep serving until
    Ctrl-C (or SIGTERM, which run_cli reports); returns 0 once stopped by Ctrl-C."""
    import netron
    logging.getLogger("netron").setLevel(logging.WARNING)  # its own 'Serving ...' lines: ours name every graph
    try:
        for path, port in zip(paths, ports(first, len(paths))):
            _own_handler(netron)
            bound = netron.serve(path, address=(host, port), browse=False)
            print(f"netron: http://{bound[0]}:{bound[1]}  {path}", file=out, flush=True)
        print("serving until Ctrl-C", file=out, flush=True)
        while netron.status():  # the servers are daemon threads: this process must stay
            time.sleep(0.2)
        return 0
    except KeyboardInterrupt:
        print("netron: stopped", file=out, flush=True)
        return 0
    finally:
        netron.stop()

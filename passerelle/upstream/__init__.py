"""A lean HTTP/1.1 client to the runtimes: keep-alive pools (client), the protocol (http1).
Imports nothing else of passerelle."""

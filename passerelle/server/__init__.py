"""The HTTP front: the ASGI app, its one route table, the admin listener and runtime control routes.

Top layer: may import every other subpackage; nothing imports it but the CLI."""

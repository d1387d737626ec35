"""Fleet: the central service of a bare-metal GPU inference fleet (see docs/design.md)."""

__version__ = "0.1.0"

"""A throwaway redis-server stopped by PID (moved to ``loadlab.redis_server``)."""

from loadlab.redis_server import REDIS_SERVER, RedisServer, make_tls_files

__all__ = ["REDIS_SERVER", "RedisServer", "make_tls_files"]

"""One HTTP exchange as Envoy shows it: the session and the ext_proc wire messages."""

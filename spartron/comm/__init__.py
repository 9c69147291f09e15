"""spartron.comm: how bytes move between ranks."""

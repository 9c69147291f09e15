"""spartron.parallel"""

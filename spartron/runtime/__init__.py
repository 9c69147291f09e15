"""spartron.runtime"""

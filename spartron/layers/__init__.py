"""spartron.layers"""

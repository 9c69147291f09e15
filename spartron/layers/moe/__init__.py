"""spartron.layers.moe"""

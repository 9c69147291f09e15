"""spartron.launch"""

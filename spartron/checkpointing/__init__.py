"""spartron.checkpointing"""

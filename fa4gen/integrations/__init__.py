"""Adapters that let frameworks call fa4gen (imported only on request; nothing in the chain imports them)."""

"""Matchmaking over the DHT: declarations, Moshpit group keys, the matchmaker and its settings."""

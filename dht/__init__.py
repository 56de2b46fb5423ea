"""swarmavg.dht"""

"""swarmavg.compression"""

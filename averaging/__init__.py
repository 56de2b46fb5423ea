"""swarmavg.averaging"""

"""The machine Warmslot runs on: its GPUs and their free memory (devices), the programs it
starts (process: own group, polite stop, then kill all), memory pressure,
the one scheduler of background sweeps, the system libraries the tray needs, and
starting at login.
"""

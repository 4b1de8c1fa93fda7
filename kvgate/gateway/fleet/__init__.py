"""The fleet: instances and their health, what the engines report, the load account's rows shared
between replicas, and adding or removing instances at run time.
"""

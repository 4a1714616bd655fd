"""The bottom layer: how ranks start and talk.

    runtime   MPI + Horovod start-up, groups of ranks (process sets), device, seeds, abort-on-error
    traffic   the traffic meter: the one door every collective and message goes through

Nothing here knows a training method, a model or the configuration beyond its error type.
"""

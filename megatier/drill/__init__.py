"""Failure drills: a job on a simulated cluster, a failure injected, the recovery judged.

    spec       DrillSpec (what to drill, typed), LaunchSettings, DrillError
    cluster    LocalCluster: one torchrun agent per simulated node on this host
    job        a drilled job: its config, launches, metrics, and the damage a failure class does
    harness    drill(spec) -> DrillResult: inject, relaunch, compare with a fault-free run
    report     what each failure class requires of a recovery, and the report's text

``megatier-drill`` and ``megatier-launch`` parse arguments into these; the benchmarks and the fault campaign
(tools/chaos) import them.
"""

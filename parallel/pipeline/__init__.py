"""Pipeline parallelism: schedules as data (``schedules/``), a simulator that times and checks them,
and (next) the executor that runs the same action lists on stage modules."""

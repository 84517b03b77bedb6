"""Tools around the runtime, none of it imported by it.

* ``demo.py``             ``python -m dtensor_ring demo``: train with context parallelism next to
  one process
* ``accuracy_check.py``   ``python -m dtensor_ring check``: every schedule against float64
* ``numerics.py``         the float64 references and ``TOLERANCE``, the tests' and benchmarks' too
* ``numerics_report.py``  ``python -m dtensor_ring.tools.numerics_report``: error against W
* ``numerics_plot.py``    its PNG
* ``launch.py``           the launcher of the tools' processes
"""

"""``ling3-rknn doctor``: is this board ready to serve, and how to fix what is not.

Small modules with one job each: ``sysfs`` reads procfs/sysfs below an injectable root,
``board`` checks the RK3588 (SoC, rknpu driver, librknnrt, governors, clocks, thermals),
``host`` what any machine has (packages, memory), ``graphs`` the bundle and its NPU
graphs, ``report`` prints, ``command`` runs them all.
"""

from ling3_rknn.doctor.command import diagnose, run_doctor
from ling3_rknn.doctor.report import Check, Report
from ling3_rknn.doctor.sysfs import SysRoot

__all__ = ["Check", "Report", "SysRoot", "diagnose", "run_doctor"]

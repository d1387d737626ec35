#!/bin/sh
# ipmi_sim's chassis_control program: a template, filled in by fleet.lab.ipmi_sim.IpmiSim.
# Part of the EMULATOR (a stand-in for a server's power electronics, used by tests and later the
# virtual colo). ipmi_sim runs "$0 get power boot ..." (answer "power:0|1" lines) and
# "$0 set power 1", "set power 0" (a "chassis power cycle" arrives as "set power 0" and, about
# a second later, "set power 1"), "set reset 1", "set shutdown 1", "set identify ...".
# State lives in files next to $S; every "set" is APPENDED to $S.log as "<epoch> set power 0".
# SOFT_OFF=1: a soft shutdown ("set shutdown 1") powers the chassis off at once, like an OS that
# honours the ACPI request; 0: it is logged and ignored, like a hung OS.
S="${CHASSIS_STATE:-@STATE_DIR@/chassis}"
SOFT_OFF="${CHASSIS_SOFT_OFF:-@SOFT_OFF@}"
op=$1; shift
case "$op" in
  get) for k in "$@"; do
         case "$k" in
           power) echo "power:$(cat "$S.power" 2>/dev/null || echo 0)";;
           boot)  echo "boot:$(cat "$S.boot" 2>/dev/null || echo default)";;
         esac
       done;;
  set) while [ $# -ge 2 ]; do
         echo "$2" > "$S.$1"
         echo "$(date +%s) set $1 $2" >> "$S.log"
         if [ "$1" = shutdown ] && [ "$2" = 1 ] && [ "$SOFT_OFF" = 1 ]; then
           echo 0 > "$S.power"
         fi
         shift 2
       done;;
  check) exit 0;;
esac
exit 0

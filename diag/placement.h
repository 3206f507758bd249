// Where the ranks run and what they run: which CPUs each rank may run on, the
// warnings a user needs when a launcher's binding or too many ranks per host
// leave Gloo's threads without a CPU, and ranks that run different builds or
// library versions.
//
// Why it matters: a Gloo rank runs at least two busy threads (the rank's own
// and Gloo's network thread, which spins while it waits). With more ranks on
// a host than CPUs they may use, a small all_reduce takes milliseconds (a
// scheduler tick) instead of microseconds; with a rank bound to one CPU (what
// `mpirun` does by default for two ranks), its two threads share that CPU and
// small all_reduces can slow down. Neither is an error: the run stays correct,
// only slower, so these are warnings in the report and on stderr.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "reports/report.h"

namespace ddpdiag {

// The CPUs this process may run on (sched_getaffinity), ascending; empty when
// the kernel does not say.
std::vector<int> allowed_cpus();

// "0-3,8,10-11" for {0,1,2,3,8,10,11}; "" for none. Input in any order,
// duplicates allowed.
std::string format_cpu_list(std::vector<int> cpus);

// The inverse of format_cpu_list; throws std::invalid_argument naming the
// bad part of s.
std::vector<int> parse_cpu_list(std::string_view s);

// The warnings for a Gloo job (none for NCCL: its ranks are bound by design).
// ranks[i].cpus is rank i's allowed-CPU list ("" when unknown: that rank is
// left out); machines[i] is the machine rank i runs on (ranks with the same
// machine share its CPUs; "host#boot-id" keys are shown as "host"). Two kinds, at most one message each:
//   cpu_oversubscribed  a machine runs more ranks than the CPUs they may use
//                       all together;
//   cpu_single          ranks (on machines not already oversubscribed) that
//                       may each use one CPU only.
std::vector<reports::Warning> placement_warnings(const std::vector<reports::RankInfo>& ranks,
                                                 const std::vector<std::string>& machines);

// The warnings about the network a Gloo job's ranks use, from each rank's
// net_* and faster_* fields (placement: machines[i] as above). Only for jobs
// on more than one machine: on one, the traffic never leaves it. At most one
// message each:
//   slower_interface   ranks whose traffic goes over an interface slower
//                      than another one of their host, on a network where
//                      another host has an address too (Gloo bound to the
//                      wrong NIC: the hostname's address, a management
//                      network); names the faster one and GLOO_SOCKET_IFNAME;
//   egress_interface   ranks whose host routes their traffic to some peers
//                      out by another interface than the one Gloo listens
//                      on (RankInfo::egress): names both, the gateway and
//                      the peers;
//   mixed_link_speeds  the machines' links run at different known speeds:
//                      a ring all_reduce runs at the slowest.
std::vector<reports::Warning> network_warnings(const std::vector<reports::RankInfo>& ranks,
                                               const std::vector<std::string>& machines);

// Ranks that run different software, one warning per kind, from each rank's
// ddpdiag build ("0.1.0 (abc1234)") and backend library ("gloo 0.5.0",
// "nccl 2.28.9"), indexed by rank ("" = unknown, left out):
//   ddpdiag_version_mismatch  the ranks were started from different builds;
//   library_version_mismatch  different versions of the backend's library,
//                             which fail or hang in init or a collective.
std::vector<reports::Warning> mismatch_warnings(const std::vector<std::string>& builds,
                                                const std::vector<std::string>& libraries,
                                                const std::string& backend);

}  // namespace ddpdiag

// Package hwbreak tells whether a tracer's hardware breakpoints work on this
// host, and turns CRIU's use of them off where they do not.
//
// CRIU stops a dumped task after its parasite, and a restored one after its
// restorer, by putting a hardware breakpoint (x86 debug registers, set with
// PTRACE_POKEUSER) on the task's last rt_sigreturn and waiting for the trap.
// Some hypervisors do not virtualize the debug registers (AMD SEV guests
// without debug virtualization, seen here on an "AMD EPYC" VM): the register
// writes succeed, the trap never comes, and every dump and restore hangs in
// wait4 for good. CRIU 4.2 probes for this in its kerndat; CRIU 4.1.1, which
// LazyFork installs, does not. Its documented switch, the fault-injection
// code CRIU_FAULT=130 (FI_NO_BREAKPOINTS), makes it step the task to that
// syscall with PTRACE_SYSCALL instead: a few more ptrace stops, no patch.
//
// Work probes once per process; CRIUEnv adds the switch to an environment
// for CRIU (the shim's runc calls, the test and benchmark harnesses' daemons,
// direct CRIU runs) where the probe finds breakpoints broken.
package hwbreak

package client

import "time"

// ForkStep is a step of one fork's making, reported to WithStepTrace.
type ForkStep string

// The steps of a fork, in order. Each is reported when it ends.
const (
	StepQueued    ForkStep = "queued"    // the fork may begin (a slot of the batch is free)
	StepRootfs    ForkStep = "rootfs"    // its rootfs snapshot is prepared (and the layer copied in)
	StepContainer ForkStep = "container" // its containerd container exists
	StepCreate    ForkStep = "create"    // its task is created (the shim restored it, stopped before resume)
	StepStart     ForkStep = "start"     // its task runs
	StepDone      ForkStep = "done"      // recorded (labels), the fork is made
)

// WithStepTrace has every fork of the call report each step to f as it
// ends (f is called from several goroutines at once). For benchmarks and
// debugging: where a batch of forks spends its time.
func WithStepTrace(f func(id string, step ForkStep, at time.Time)) ForkOpt {
	return func(c *forkConfig) { c.trace = f }
}

func (c *forkConfig) step(id string, s ForkStep) {
	if c.trace != nil {
		c.trace(id, s, time.Now())
	}
}

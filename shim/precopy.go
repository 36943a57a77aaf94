package shim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/log"

	"github.com/lazyfork/lazyfork/internal/cgroupmem"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/memfile"
	"github.com/lazyfork/lazyfork/memfile/rehome/movehelper"
)

// The precopy: a container's first move copies its whole heap while it is
// frozen (300 ms a GiB here). When a client says a snapshot follows
// (SnapshotIntent), the shim has the standby helper copy the container's
// private anonymous memory into the move's file now, while it runs
// (rehome.PreCopy: a userfaultfd in asynchronous write-protect mode marks
// what it writes meanwhile; the container is frozen only for the
// userfaultfd's injection, a few milliseconds). The helper keeps the
// userfaultfds and waits for that container's move alone (not as the shim's
// standby helper, which any container's move takes: that move would pay for
// dropping the precopy, and a second precopy in the family would discard
// the first); the move copies only the pages written since. Pause waits for
// a precopy under way.
//
// Only for a container that has not moved yet (a later move is a delta
// already), with at least Config.PreCopyMin to copy (128 MiB), on cgroup v1 (the
// helper copies from the container's memory cgroup, which on v2 is the one
// it freezes), with the standby helper on, and with room under its memory
// limit for its memory twice (the precopy holds it twice until the move).
// A precopy the move does not take is dropped with its helper after
// Config.RehomeStandby. LAZYFORK_PRECOPY=off turns it off.
type preCopyRun struct {
	done chan struct{}
	// pf and h, the precopy's file and the helper holding its
	// userfaultfds, are set once the precopy holds something; frozen is
	// how long it froze the container (for the injection).
	pf     *memfile.PendingFile
	h      *helperProc
	frozen time.Duration
	timer  *time.Timer
}

var (
	preCopiesMu sync.Mutex
	preCopies   = map[string]*preCopyRun{}
)

// startPreCopy begins a precopy of the container, in the background.
func (s *Service) startPreCopy(ctx context.Context, st *containerState) {
	if !s.cfg.PreCopy || s.cfg.RehomeStandby <= 0 || len(st.MovedFiles) > 0 {
		return
	}
	key := st.Namespace + "/" + st.ID
	run := &preCopyRun{done: make(chan struct{})}
	preCopiesMu.Lock()
	if preCopies[key] != nil {
		preCopiesMu.Unlock()
		return
	}
	preCopies[key] = run
	preCopiesMu.Unlock()
	ctx = context.WithoutCancel(ctx)
	go func() {
		defer close(run.done)
		reply, err := s.preCopy(ctx, st, run)
		l := log.G(ctx).WithField("id", st.ID)
		if reply != nil {
			l = l.WithFields(log.Fields{"precopied": reply.PreCopied, "vmas": reply.PreCopyVMAs, "duration": reply.PreCopy, "frozen": reply.Frozen, "protect": reply.Protect})
		}
		switch {
		case err != nil:
			l.WithError(err).Debug("lazyfork: no precopy")
		case reply.PreCopied == 0:
			l.Debug("lazyfork: no precopy (too little private memory)")
		default:
			l.Info("lazyfork: precopy")
		}
		preCopiesMu.Lock()
		defer preCopiesMu.Unlock()
		if run.pf == nil {
			delete(preCopies, key)
			return
		}
		// Not taken by a move within the helper's wait: dropped.
		run.timer = time.AfterFunc(s.cfg.RehomeStandby, func() {
			preCopiesMu.Lock()
			mine := preCopies[key] == run
			if mine {
				delete(preCopies, key)
			}
			preCopiesMu.Unlock()
			if mine {
				run.h.stop()
				run.pf.Abort()
			}
		})
	}()
}

// preCopy runs the precopy (startPreCopy) and leaves its helper with run
// for the container's move (or as the standby helper if it copied nothing).
func (s *Service) preCopy(ctx context.Context, st *containerState, run *preCopyRun) (*movehelper.Reply, error) {
	ts, err := s.TTRPCTaskService.State(ctx, &taskAPI.StateRequest{ID: st.ID})
	if err != nil {
		return nil, err
	}
	pid := int(ts.Pid)
	freezer, err := freezerCgroup(pid)
	if err != nil {
		return nil, err
	}
	if mem, err := memoryCgroupDir(pid); err != nil || mem == freezer {
		return nil, errors.New("cgroup v2: the container's memory cgroup is the one the precopy freezes")
	}
	if path, _, err := procfs.Cgroup(pid, "memory"); err == nil {
		if limit, usage, ok, err := cgroupmem.Limit(path); err == nil {
			// Its cgroup's usage bounds its private memory: a container
			// below the bound is left alone without a helper or a file.
			if usage < s.cfg.PreCopyMin {
				return nil, fmt.Errorf("%d MiB in its memory cgroup, below LAZYFORK_PRECOPY's %d MiB", usage>>20, s.cfg.PreCopyMin>>20)
			}
			if ok && limit-usage < usage {
				return nil, fmt.Errorf("%d MiB under the memory limit: no room for the container's memory twice", (limit-usage)>>20)
			}
		}
	}
	pids, err := cgroupProcs(freezer)
	if err != nil {
		return nil, err
	}
	store, err := s.Store()
	if err != nil {
		return nil, err
	}
	h := takeStandbyHelper()
	if h == nil {
		if h, err = s.startHelper(); err != nil {
			return nil, err
		}
	}
	pf, err := store.CreateFile(st.Family)
	if err != nil {
		putStandbyHelper(h, s.cfg.RehomeStandby)
		return nil, err
	}
	keep := false
	defer func() {
		if !keep {
			pf.Abort()
		}
	}()
	// What it copies is charged to the container; it waits in the shim's
	// cgroup again.
	h.join(ctx, pid)
	if memoryCgroupOf(h.cmd.Process.Pid) != memoryCgroupOf(pid) {
		putStandbyHelper(h, s.cfg.RehomeStandby)
		return nil, errors.New("the helper could not join the container's memory cgroup")
	}
	defer func() {
		if err := joinMemoryCgroup(os.Getpid(), h.cmd.Process.Pid); err != nil {
			log.G(ctx).WithError(err).Warn("lazyfork: the precopy's helper stays in the container's memory cgroup")
		}
	}()
	var killed atomic.Bool
	timer := time.AfterFunc(s.cfg.RestoreTimeout, func() {
		killed.Store(true)
		_ = h.cmd.Process.Kill()
	})
	req := movehelper.Request{PreCopy: true, Freezer: freezer, Pids: pids, HostFile: pf.Path(), MemDir: memfile.MountPath, MinBytes: s.cfg.PreCopyMin}
	var reply movehelper.Reply
	err = json.NewEncoder(h.stdin).Encode(&req)
	if err == nil {
		var line []byte
		if line, err = h.out.ReadBytes('\n'); err == nil {
			err = json.Unmarshal(line, &reply)
		}
	}
	timer.Stop()
	if err != nil || killed.Load() {
		h.stop()
		return nil, fmt.Errorf("precopy helper: no reply (killed after %s: %v): %w", s.cfg.RestoreTimeout, killed.Load(), err)
	}
	if reply.Err != "" {
		err = errors.New(reply.Err)
	}
	if reply.PreCopied == 0 {
		putStandbyHelper(h, s.cfg.RehomeStandby)
		return &reply, err
	}
	keep = true
	preCopiesMu.Lock()
	run.pf, run.h, run.frozen = pf, h, reply.Frozen
	preCopiesMu.Unlock()
	return &reply, err
}

// waitPreCopy waits for the container's precopy under way, if any, at most
// the restore timeout: Pause freezes it only once the copy is done.
func (s *Service) waitPreCopy(key string) {
	preCopiesMu.Lock()
	run := preCopies[key]
	preCopiesMu.Unlock()
	if run == nil {
		return
	}
	select {
	case <-run.done:
	case <-time.After(s.cfg.RestoreTimeout):
	}
}

// takePreCopy returns the container's finished precopy (its file, the
// helper holding it, its freeze) for its move, or nil if none: then the move
// makes its own file and takes the standby helper.
func takePreCopy(key string) *preCopyRun {
	preCopiesMu.Lock()
	run := preCopies[key]
	if run == nil {
		preCopiesMu.Unlock()
		return nil
	}
	select {
	case <-run.done:
	default:
		// Still copying (Pause gave up waiting): the move makes its own.
		preCopiesMu.Unlock()
		return nil
	}
	delete(preCopies, key)
	preCopiesMu.Unlock()
	if run.timer != nil {
		run.timer.Stop()
	}
	if run.pf == nil {
		return nil
	}
	return run
}

package main

import (
	"fmt"
	"path/filepath"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// criuLogWatch times the CRIU restore logs of the containers created in a
// runtime's task directory: when each log is created (CRIU's time 0: it
// opens the log as it starts logging, and its lines are stamped from
// there) and when it is last closed (CRIU's exit). The log's mtime cannot
// tell either: ext4 stamps a file nobody stats with the coarse clock, a
// median 3.4 ms (up to 5.5) late on this host, which moved that much of
// runc's start-up into "runc exit".
type criuLogWatch struct {
	fd   int
	mu   sync.Mutex
	dirs map[int32]string // watch descriptor -> container id ("" for the task directory)
	logs map[string]*criuLogTimes
	stop chan struct{}
	done chan struct{}
}

// criuLogTimes is one container's restore log: created, and last closed.
type criuLogTimes struct{ created, closed time.Time }

// watchCRIULogs watches taskDir (ROOT/io.containerd.runtime.v2.task/NS,
// where a container's work directory, and so its restore.log, is made; the
// parent's container made it).
func watchCRIULogs(taskDir string) (*criuLogWatch, error) {
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("inotify: %w", err)
	}
	w := &criuLogWatch{fd: fd, dirs: map[int32]string{}, logs: map[string]*criuLogTimes{},
		stop: make(chan struct{}), done: make(chan struct{})}
	wd, err := unix.InotifyAddWatch(fd, taskDir, unix.IN_CREATE|unix.IN_ONLYDIR)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("watch %s: %w", taskDir, err)
	}
	w.dirs[int32(wd)] = ""
	go w.run(taskDir)
	return w, nil
}

// run reads events until close: a new container directory gets a watch of
// its own at once (CRIU starts logging 10 ms or more after containerd makes
// it), and its restore.log's first create and every close are stamped on
// arrival (a blocked reader wakes within a few microseconds on a quiet host).
func (w *criuLogWatch) run(taskDir string) {
	defer close(w.done)
	buf := make([]byte, 64<<10)
	pfd := []unix.PollFd{{Fd: int32(w.fd), Events: unix.POLLIN}}
	for {
		select {
		case <-w.stop:
			return
		default:
		}
		if _, err := unix.Poll(pfd, 100); err != nil && err != unix.EINTR {
			return
		}
		n, err := unix.Read(w.fd, buf)
		now := time.Now()
		if err != nil || n <= 0 {
			continue
		}
		for off := 0; off+unix.SizeofInotifyEvent <= n; {
			ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
			name := ""
			if ev.Len > 0 {
				raw := buf[off+unix.SizeofInotifyEvent : off+unix.SizeofInotifyEvent+int(ev.Len)]
				for i, c := range raw {
					if c == 0 {
						raw = raw[:i]
						break
					}
				}
				name = string(raw)
			}
			off += unix.SizeofInotifyEvent + int(ev.Len)
			w.event(taskDir, ev.Wd, ev.Mask, name, now)
		}
	}
}

func (w *criuLogWatch) event(taskDir string, wd int32, mask uint32, name string, now time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	id, ok := w.dirs[wd]
	switch {
	case !ok:
	case id == "" && mask&unix.IN_CREATE != 0 && mask&unix.IN_ISDIR != 0:
		cwd, err := unix.InotifyAddWatch(w.fd, filepath.Join(taskDir, name), unix.IN_CREATE|unix.IN_CLOSE_WRITE)
		if err == nil {
			w.dirs[int32(cwd)] = name
		}
	case id != "" && name == "restore.log":
		t := w.logs[id]
		if t == nil {
			t = &criuLogTimes{}
			w.logs[id] = t
		}
		if mask&unix.IN_CREATE != 0 && t.created.IsZero() {
			t.created = now
		}
		if mask&unix.IN_CLOSE_WRITE != 0 {
			t.closed = now
		}
	}
}

// times is id's restore log's creation and last close, once both were seen.
func (w *criuLogWatch) times(id string) (created, closed time.Time, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	t := w.logs[id]
	if t == nil || t.created.IsZero() || t.closed.IsZero() {
		return time.Time{}, time.Time{}, fmt.Errorf("no create and close of %s's restore.log were seen: %w", id, errCRIULogTiming)
	}
	return t.created, t.closed, nil
}

func (w *criuLogWatch) close() {
	close(w.stop)
	<-w.done
	unix.Close(w.fd)
}

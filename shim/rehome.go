package shim

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/internal/cgroupmem"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/memfile"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
	"github.com/lazyfork/lazyfork/memfile/rehome/movehelper"
)

// rehomeResult is what a move did, for the log and the container's state.
type rehomeResult struct {
	File     string // the new memory file ("" if nothing moved)
	VMAs     int
	Bytes    int64
	ByTracer int64 // of Bytes, copied by the helper instead of the process
	Duration time.Duration
	// HelperRun is the helper's run as the shim saw it (start to reply),
	// of Duration.
	HelperRun time.Duration
	helperRun
	Helper movehelper.Reply // the helper's own account (calls, timings)
	// NoNewPrivs lists processes that got no_new_privs for the madvise
	// guard (they had no CAP_SYS_ADMIN).
	NoNewPrivs []int
	// PreCopyFrozen is how long the precopy the move took froze the
	// container before (its injection), outside this pause.
	PreCopyFrozen time.Duration
}

// rehomeEnabled reports whether a container's memory moves onto its files at
// checkpoint: the shim setting, then the container's annotation. A zero-mode
// madvise guard needs a supervisor tracing the task, which a move cannot
// share: those containers keep today's behaviour.
func (s *Service) rehomeEnabled(st *containerState, mode madvguard.Mode, guard bool) bool {
	if !s.cfg.Rehome || st.Rehome == "false" {
		return false
	}
	return !guard || mode == madvguard.Refuse
}

// madviseOf is a container's madvise guard: its annotation's, else the
// shim setting's.
func (s *Service) madviseOf(st *containerState) (madvguard.Mode, bool, error) {
	if st.Madvise != "" {
		return parseMadvise(st.Madvise)
	}
	return parseMadvise(s.cfg.Madvise)
}

// movesAtCheckpoint reports whether a checkpoint of the container, frozen,
// would move it onto a memory file (rehomeEnabled).
func (s *Service) movesAtCheckpoint(st *containerState) bool {
	mode, guard, err := s.madviseOf(st)
	if err != nil || st.View == "" || !s.rehomeEnabled(st, mode, guard) {
		return false
	}
	if s.patchesDeltas(st) && len(st.MovedFiles) > 0 {
		_, moveDue := patchedNext(st.Namespace + "/" + st.ID)
		return moveDue
	}
	return true
}

// rehomeContainer moves the private anonymous memory of every process of a
// frozen container onto one new memory file of its family, in place
// (package rehome: each VMA's pages are copied into the file and the VMA is
// replaced by a MAP_PRIVATE mapping of it, chunk by chunk, by syscalls
// injected while the processes are stopped), and installs the madvise guard
// on the moved ranges, which now bring back file bytes on MADV_DONTNEED as in
// a fork. The container then holds its heap once, in the page cache shared
// with its forks, and its next dump holds only the pages it wrote since.
//
// The work runs in a helper process (lazyfork-rehome beside the shim, or
// this binary where it is missing): the shim's reaper waits for any child and
// would take the ptrace stops of the container's processes, which are the
// shim's children. The helper is put into the container's memory cgroup
// (cgroup v1; on v2 that cgroup is the frozen one) before it copies, so the
// file's pages are charged to the container whose memory they hold; chunks
// bound what the container holds twice during the move.
//
// A failure before the first chunk is mapped leaves the container as it was;
// after that, each chunk is either moved or left as it was, never lost, and
// the file stays referenced by the container.
func (s *Service) rehomeContainer(ctx context.Context, st *containerState, initPID int, mode madvguard.Mode, guard bool) (res rehomeResult, retErr error) {
	t0 := time.Now()
	defer func() { res.Duration = time.Since(t0) }()
	warmForMove(ctx) // again: the pause's may have passed since
	if st.View == "" {
		return res, fmt.Errorf("container %s has no memory view (created by an older shim): %w", st.ID, errdefs.ErrFailedPrecondition)
	}
	freezer, err := freezerCgroup(initPID)
	if err != nil {
		return res, err
	}
	pids, err := cgroupProcs(freezer)
	if err != nil {
		return res, err
	}
	chunk, err := moveChunk(initPID)
	if err != nil {
		return res, err
	}
	store, err := s.Store()
	if err != nil {
		return res, err
	}
	key := st.Namespace + "/" + st.ID
	var pf *memfile.PendingFile
	var preCopier *helperProc
	pre := takePreCopy(key)
	preCopied := pre != nil
	if preCopied {
		pf, preCopier, res.PreCopyFrozen = pre.pf, pre.h, pre.frozen
	} else {
		if pf, err = store.CreateFile(st.Family); err != nil {
			return res, err
		}
	}
	holder := movedHolder(st.Namespace, st.ID, pf.Name())
	if err := pf.Publish(holder); err != nil {
		pf.Abort()
		return res, err
	}
	linked, nothingMoved := false, false
	var hop *preparedHop
	defer func() {
		if hop != nil && hop.kept {
			// The consolidated file: recorded with the container's state
			// (by the caller, as res.File, or here beside it).
			defer func() {
				if res.File == "" {
					res.File = hop.pf.Name()
				} else {
					st.MovedFiles = append(st.MovedFiles, hop.pf.Name())
				}
			}()
		}
		if !nothingMoved && linked {
			// Moved, or maybe in part (a helper that died): the processes
			// may map the file, and a later dump needs it in their view.
			if err := pf.Seal(); err != nil {
				retErr = errors.Join(retErr, fmt.Errorf("seal %s: %w", pf.Name(), err))
			}
			return
		}
		// Nothing maps the file: it goes (GC frees it once unreferenced).
		if linked {
			os.Remove(filepath.Join(store.ViewDir(st.View), pf.Name()))
		}
		pf.Abort()
		res.File = ""
	}()
	if _, err := store.LinkView(st.Family, st.View, []string{pf.Name()}); err != nil {
		return res, fmt.Errorf("link memory file %s into the view of %s: %w", pf.Name(), st.ID, err)
	}
	linked = true
	res.File = pf.Name()
	req := movehelper.Request{
		Freezer: freezer, Pids: pids, HostFile: pf.Path(), Inside: filepath.Join(memfile.MountPath, pf.Name()),
		Guard: guard, Mode: int(mode), Chunk: chunk, MemDir: memfile.MountPath, PreCopied: preCopied,
	}
	hop = takePrepared(key)
	hopped := false // or maybe: a helper that failed may have mapped some
	if hop != nil {
		// A consolidation prepared after the last checkpoint: its regions
		// are mapped whole from its file before the move plans.
		defer func() { hop.finish(ctx, store, st, hopped) }()
		if err := hop.pf.Publish(movedHolder(st.Namespace, st.ID, hop.pf.Name())); err != nil {
			log.G(ctx).WithError(err).Warn("lazyfork: publish a prepared consolidation")
		} else if _, err := store.LinkView(st.Family, st.View, []string{hop.pf.Name()}); err != nil {
			log.G(ctx).WithError(err).Warn("lazyfork: link a prepared consolidation into the view")
		} else {
			hop.linked = true
			req.Hop = &movehelper.Hop{HostFile: hop.pf.Path(), Inside: filepath.Join(memfile.MountPath, hop.pf.Name()), Regions: hop.regions}
		}
	}
	tHelper := time.Now()
	reply, err := s.runRehomeHelper(ctx, initPID, &req, hop, preCopier, &res.helperRun)
	res.HelperRun = time.Since(tHelper)
	// Kept if any process maps any of it: a region can fail part way
	// (chunk by chunk), its first chunks mapped from the file.
	hopped = req.Hop != nil && memfile.MappedBy(pids, hop.pf.Path())
	if req.ChargedTo != "" {
		if err := store.SetCharge(st.Family, pf.Name(), req.ChargedTo); err != nil {
			log.G(ctx).WithError(err).Warn("lazyfork: record where a moved file is charged")
		}
	}
	if err == nil {
		// After a consolidation tried, mapped or refused, the count
		// starts again: a refused one is not prepared again at once.
		noteMove(key, initPID, reply.Patches, req.Hop != nil)
	}
	if err != nil {
		// The container must be as its pauser left it: frozen.
		if ferr := freezeCgroup(freezer); ferr != nil {
			err = errors.Join(err, ferr)
		}
		return res, err
	}
	res.VMAs, res.Bytes, res.ByTracer, res.NoNewPrivs = reply.VMAs, reply.Bytes, reply.ByTracer, reply.NoNewPrivs
	res.Helper = *reply
	if reply.Err != "" {
		return res, errors.New(reply.Err)
	}
	nothingMoved = res.VMAs == 0 && res.Bytes == 0
	return res, nil
}

// freeReplaced frees the pages of older memory files that a move replaced
// (the container wrote them, and now maps the new file there) once nothing
// else can read them: without it a parent that keeps writing new pages keeps
// both copies of each on the tmpfs. It runs after the dump, off the pause:
// it reads every process's mappings on the host (tens of milliseconds beside
// a hundred containers), and the container maps none of these ranges either
// way.
func (s *Service) freeReplaced(ctx context.Context, st *containerState, replaced []memfile.FileRange) {
	if len(replaced) == 0 {
		return
	}
	store, err := s.Store()
	if err == nil {
		var freed int64
		freed, err = store.PunchUnused(st.Family, st.ownsHolder, replaced)
		log.G(ctx).WithFields(log.Fields{"id": st.ID, "freed": freed}).Debug("lazyfork: freed the pages a move replaced")
	}
	if err != nil {
		log.G(ctx).WithError(err).WithField("id", st.ID).Warn("lazyfork: free the pages a move replaced")
	}
}

// ownsHolder reports whether a holder of the family's files is the
// container itself: its restore, or a file its processes were moved onto.
func (st *containerState) ownsHolder(h string) bool {
	return h == containerHolder(st.Namespace, st.ID) || strings.HasPrefix(h, movedHolder(st.Namespace, st.ID, "")) ||
		strings.HasPrefix(h, patchesHolder(st.Namespace, st.ID, ""))
}

// movedHolder is the reference a container holds on a file its own processes
// were moved onto.
func movedHolder(ns, id, file string) string { return "moved:" + ns + "/" + id + "/" + file }

// RehomeHelper is the binary of a move's helper process, beside the shim's
// (movehelper: it starts in a third of the shim's time, inside the pause);
// the shim's own binary runs the helper where it is missing.
const RehomeHelper = "lazyfork-rehome"

// isFile reports whether path names a regular file.
func isFile(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular()
}

// helperRun is what the shim sees of a helper's run besides its reply.
type helperRun struct {
	Binary string // the helper's program
	// Join is the shim's move of the helper into the container's memory
	// cgroup (the helper seizes and plans meanwhile).
	Join time.Duration
	// Standby: the helper was started before the freeze (standbyHelper),
	// its start-up outside the pause; Preloaded: a consolidation's regions
	// were sent to it then.
	Standby, Preloaded bool
}

// helperProc is a started move helper, waiting for its request on stdin.
type helperProc struct {
	cmd            *exec.Cmd
	stdin          io.WriteCloser
	stdout, stderr io.ReadCloser
	out            *bufio.Reader // stdout's: a precopy's reply line, then the move's
	run            helperRun
	// preloaded is the consolidation whose regions went ahead of the
	// request (standbyHelper.preload).
	preloaded *preparedHop
}

// startHelper starts a move's helper. The shim's reaper (containerd's, on
// SIGCHLD) reaps it: its reply on stdout, complete or not, is its result,
// and the shim does not subscribe to its exit (a subscription nobody reads
// while a standby helper waits would stall the reaper's other
// notifications). Its os.Process holds a pidfd, so a kill never reaches a
// process that took its pid after the reap.
func (s *Service) startHelper() (*helperProc, error) {
	cmd := exec.Command(s.self, HookArg, "rehome")
	if helper := filepath.Join(filepath.Dir(s.self), RehomeHelper); isFile(helper) {
		cmd = exec.Command(helper)
	}
	h := &helperProc{cmd: cmd}
	h.run.Binary = filepath.Base(cmd.Path)
	var err error
	if h.stdin, err = cmd.StdinPipe(); err == nil {
		if h.stdout, err = cmd.StdoutPipe(); err == nil {
			h.out = bufio.NewReader(h.stdout)
			h.stderr, err = cmd.StderrPipe()
		}
	}
	if err == nil {
		err = cmd.Start()
	}
	if err != nil {
		h.closePipes()
		return nil, fmt.Errorf("start the rehome helper: %w", err)
	}
	return h, nil
}

// closePipes closes the shim's ends of the helper's stdio (never Wait: the
// reaper takes the exit).
func (h *helperProc) closePipes() {
	for _, c := range []io.Closer{h.stdin, h.stdout, h.stderr} {
		if c != nil {
			c.Close()
		}
	}
}

// join puts the helper into the memory cgroup of the container of initPID
// (cgroup v1): the file pages it writes are then charged to the container
// whose memory they hold. On cgroup v2 that cgroup is the frozen one, and a
// process moved into a frozen cgroup freezes: the helper stays out, the
// processes write their pages themselves, charged to it, and what the
// helper copies (runs of under 16 pages) is charged to the shim.
func (h *helperProc) join(ctx context.Context, initPID int) {
	freezer, _ := freezerCgroup(initPID)
	if mem, err := memoryCgroupDir(initPID); err == nil && mem == freezer {
		log.G(ctx).Debug("lazyfork: rehome helper stays in the shim's cgroup (cgroup v2: the container's is frozen)")
		return
	}
	t0 := time.Now()
	err := joinMemoryCgroup(initPID, h.cmd.Process.Pid)
	h.run.Join = time.Since(t0)
	if err != nil {
		log.G(ctx).WithError(err).Warn("lazyfork: rehome helper stays in the shim's memory cgroup (the processes write their pages themselves; its own copies of small runs are charged to the shim)")
	}
}

// stop kills a helper that got no request (it exits by itself on EOF too:
// the shim gone, or stdin closed).
func (h *helperProc) stop() {
	_ = h.cmd.Process.Kill()
	h.closePipes()
	_ = h.cmd.Process.Release()
}

// runRehomeHelper runs a move's helper: h if not nil (the helper holding
// the container's precopy), else the standby one if one waits
// (standbyHelper; a consolidation's preparation starts its own), else a new
// one, and returns its reply;
// run gets its program and how long its move into the container's memory
// cgroup took.
func (s *Service) runRehomeHelper(ctx context.Context, initPID int, req *movehelper.Request, hop *preparedHop, h *helperProc, run *helperRun) (*movehelper.Reply, error) {
	if h != nil {
		h = h.alive()
	} else if !req.Prepare && len(req.Copies) == 0 {
		h = takeStandbyHelper()
	}
	if h == nil {
		var err error
		if h, err = s.startHelper(); err != nil {
			return nil, err
		}
	} else {
		h.run.Standby = true
	}
	defer func() { *run = h.run }()
	// A helper that hangs would keep the container frozen: it is killed
	// (its tracees go free) after the restore timeout, and the move fails.
	var killed atomic.Bool
	timer := time.AfterFunc(s.cfg.RestoreTimeout, func() {
		killed.Store(true)
		_ = h.cmd.Process.Kill()
	})
	// Nor does it outlive its caller (a Pause whose client gave up): a
	// move it leaves half done is undone as a killed helper's is.
	var cancelled atomic.Bool
	stopCancel := context.AfterFunc(ctx, func() {
		cancelled.Store(true)
		_ = h.cmd.Process.Kill()
	})
	defer stopCancel()
	// The request goes first, so that a new helper starts, seizes and
	// plans while the shim moves it into the container's memory cgroup. It
	// copies only once its stdin closes, so what it writes is charged
	// there, and it waits for that before it exits (its pid is not reused
	// meanwhile).
	send := req
	if req.Hop != nil && hop != nil && h.preloaded == hop {
		// Its regions went ahead, before the freeze.
		r := *req
		r.Hop = &movehelper.Hop{HostFile: req.Hop.HostFile, Inside: req.Hop.Inside, Preloaded: true}
		send = &r
		h.run.Preloaded = true
	}
	werr := json.NewEncoder(h.stdin).Encode(send)
	h.join(ctx, initPID)
	req.ChargedTo = memoryCgroupOf(h.cmd.Process.Pid)
	h.stdin.Close()
	// Its output ends when it exits (or is killed).
	errOut := make(chan []byte, 1)
	go func() {
		b, _ := io.ReadAll(io.LimitReader(h.stderr, 64<<10))
		errOut <- b
	}()
	out, rerr := io.ReadAll(h.out)
	stderr := <-errOut
	timer.Stop()
	stopCancel()
	h.closePipes()
	_ = h.cmd.Process.Release() // after the kills that may use it
	if killed.Load() {
		return nil, fmt.Errorf("rehome helper did not finish within %s (LAZYFORK_RESTORE_TIMEOUT) and was killed: %w", s.cfg.RestoreTimeout, context.DeadlineExceeded)
	}
	if cancelled.Load() {
		return nil, fmt.Errorf("rehome helper killed: its caller gave up: %w", ctx.Err())
	}
	var reply movehelper.Reply
	if werr != nil || rerr != nil || len(out) == 0 {
		return nil, fmt.Errorf("rehome helper: no reply: %v %v: %s", werr, rerr, strings.TrimSpace(string(stderr)))
	}
	if err := json.Unmarshal(out, &reply); err != nil {
		return nil, fmt.Errorf("rehome helper: reply %q: %w: %s", out, err, strings.TrimSpace(string(stderr)))
	}
	return &reply, nil
}

// The standby helper: a move's helper is a Go program whose start-up takes
// 12-20 ms on these hosts (exec, runtime, page faults), inside the pause. So
// the shim keeps one helper waiting for the next move of any of its
// containers (a helper is not tied to one: the request says everything):
// started after each checkpoint that moved a container (a fork of a running
// container is often followed by another), or by a snapshot intent or a
// Pause of a container that would move, before the freeze; the move takes
// it. It waits in the shim's cgroups and joins the container's memory
// cgroup only for the move (runRehomeHelper: a warm join, under a
// millisecond), so it never keeps that cgroup from being removed. At most
// one waits per shim, for Config.RehomeStandby (LAZYFORK_REHOME_STANDBY,
// one minute; "off": none): 5.2 MB RSS, 1.2 MB of it anonymous.
type standbyHelper struct {
	ready chan struct{} // closed once h is set (nil: it did not start)
	h     *helperProc
	timer *time.Timer
	// sending counts preloads under way: the request waits for them.
	sending sync.WaitGroup
}

var (
	standbyMu sync.Mutex
	standby   *standbyHelper
)

// startStandbyHelper has a helper wait for the next move, unless one waits
// already (its wait starts again). A failure costs only the saving.
func (s *Service) startStandbyHelper(ctx context.Context) {
	ttl := s.cfg.RehomeStandby
	if ttl <= 0 {
		return
	}
	standbyMu.Lock()
	old := standby
	if old != nil && old.timer.Stop() {
		old.timer.Reset(ttl)
		standbyMu.Unlock()
		return
	}
	sb := &standbyHelper{ready: make(chan struct{})}
	standby = sb
	sb.expireAfter(ttl)
	standbyMu.Unlock()
	if old != nil {
		// Its wait ended as this began: its timer's call no longer finds
		// it there, so it is stopped here.
		old.discard()
	}
	ctx = context.WithoutCancel(ctx)
	go func() {
		defer close(sb.ready)
		h, err := s.startHelper()
		if err != nil {
			log.G(ctx).WithError(err).Debug("lazyfork: no standby rehome helper")
			return
		}
		sb.h = h
	}()
}

// expireAfter stops the helper once it has waited ttl. Called with
// standbyMu held.
func (sb *standbyHelper) expireAfter(ttl time.Duration) {
	sb.timer = time.AfterFunc(ttl, func() {
		standbyMu.Lock()
		mine := standby == sb
		if mine {
			standby = nil
		}
		standbyMu.Unlock()
		if mine {
			sb.discard()
		}
	})
}

// putStandbyHelper has a started helper wait for the next move (the one
// that made a precopy: the move of its container takes it), in place of any
// other.
func putStandbyHelper(h *helperProc, ttl time.Duration) {
	sb := &standbyHelper{ready: make(chan struct{}), h: h}
	close(sb.ready)
	standbyMu.Lock()
	old := standby
	standby = sb
	sb.expireAfter(ttl)
	standbyMu.Unlock()
	if old != nil {
		old.timer.Stop()
		old.discard()
	}
}

// takeStandbyHelper returns the waiting helper, once started, if any.
func takeStandbyHelper() *helperProc {
	standbyMu.Lock()
	sb := standby
	standby = nil
	standbyMu.Unlock()
	if sb == nil {
		return nil
	}
	sb.timer.Stop()
	<-sb.ready
	sb.sending.Wait()
	if sb.h == nil {
		return nil
	}
	return sb.h.alive()
}

// alive returns h, or nil if it is gone while it waited (killed): it is
// stopped, and the move starts its own.
func (h *helperProc) alive() *helperProc {
	if h.cmd.Process.Signal(syscall.Signal(0)) != nil {
		h.stop()
		return nil
	}
	return h
}

// preloadStandbyHelper sends the regions of a container's prepared
// consolidation to the waiting helper, in the background, before the
// freeze: the move's request then only names them, and neither the shim's
// encoding of a fragmented heap's pieces nor the helper's decoding of them
// (20-25 ms at 1,150 pieces here) falls in the pause. A move of another
// container that takes the helper sends its own regions whole.
func preloadStandbyHelper(hop *preparedHop) {
	standbyMu.Lock()
	sb := standby
	if sb != nil {
		sb.sending.Add(1)
	}
	standbyMu.Unlock()
	if sb == nil {
		return
	}
	go func() {
		defer sb.sending.Done()
		<-sb.ready
		if sb.h == nil {
			return
		}
		msg := movehelper.Request{Preload: true, Hop: &movehelper.Hop{Regions: hop.regions}}
		if json.NewEncoder(sb.h.stdin).Encode(&msg) == nil {
			sb.h.preloaded = hop
		}
	}()
}

// discard stops a standby helper taken out of standby, in the background
// (it may still be starting).
func (sb *standbyHelper) discard() {
	go func() {
		<-sb.ready
		sb.sending.Wait()
		if sb.h != nil {
			sb.h.stop()
		}
	}()
}

// Chunks of a move: while one is copied, the container holds it twice (its
// anonymous pages and the file's, both charged to its memory cgroup).
const (
	maxMoveChunk = 16 << 20
	minMoveChunk = 1 << 20
)

// moveChunk sizes the chunks of a move to the headroom of the container's
// memory limit: half of it, at most maxMoveChunk. A container with less than
// two minimal chunks of headroom is refused: its move would drive it into
// its own OOM killer.
func moveChunk(pid int) (uint64, error) {
	path, _, err := procfs.Cgroup(pid, "memory")
	if err != nil {
		return maxMoveChunk, nil // no memory controller: no limit to honour
	}
	limit, usage, ok, err := cgroupmem.Limit(path)
	if err != nil || !ok {
		return maxMoveChunk, nil
	}
	headroom := int64(0)
	if limit > usage {
		headroom = limit - usage
	}
	if headroom < 2*minMoveChunk {
		return 0, fmt.Errorf("the container is %d KiB under its memory limit of %d MiB; moving its memory onto a file needs %d MiB of headroom: raise the limit, or set %s=false: %w",
			headroom>>10, limit>>20, 2*minMoveChunk>>20, api.AnnotationRehome, errdefs.ErrResourceExhausted)
	}
	return uint64(min(maxMoveChunk, headroom/2)) &^ 4095, nil
}

// cgroupDir is the directory of process pid's cgroup for a controller: in
// the controller's v1 hierarchy, or the unified one.
func cgroupDir(pid int, controller string) (string, error) {
	path, v1, err := procfs.Cgroup(pid, controller)
	if err != nil {
		return "", err
	}
	if v1 {
		return filepath.Join(cgroupRoot, controller, path), nil
	}
	return filepath.Join(cgroupRoot, path), nil
}

// memoryCgroupDir is the directory of process pid's memory cgroup.
func memoryCgroupDir(pid int) (string, error) { return cgroupDir(pid, "memory") }

// memoryCgroupOf is the path of process pid's memory cgroup ("" if unknown).
func memoryCgroupOf(pid int) string {
	path, _, _ := procfs.Cgroup(pid, "memory")
	return path
}

// joinMemoryCgroup moves process pid into the memory cgroup of process of
// (v1 memory hierarchy, or the unified one).
func joinMemoryCgroup(of, pid int) error {
	dir, err := memoryCgroupDir(of)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0)
}

// freezerCgroup is the directory of the cgroup that freezes process pid.
func freezerCgroup(pid int) (string, error) { return cgroupDir(pid, "freezer") }

// cgroupProcs lists the processes of a cgroup directory.
func cgroupProcs(dir string) ([]int, error) {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	if len(pids) == 0 {
		return nil, fmt.Errorf("cgroup %s holds no process: %w", dir, errdefs.ErrNotFound)
	}
	return pids, nil
}

// logRehome reports a move.
func logRehome(ctx context.Context, id string, res rehomeResult, err error) {
	l := log.G(ctx).WithFields(log.Fields{"id": id, "file": res.File, "vmas": res.VMAs, "bytes": res.Bytes, "by_helper": res.ByTracer, "duration": res.Duration, "helper_run": res.HelperRun, "join": res.Join,
		"seize": res.Helper.Seize, "plan": res.Helper.Plan, "copy_map": res.Helper.Move, "map": res.Helper.Map, "map_batched": res.Helper.Batched, "consolidation": res.Helper.Hop, "consolidation_check": res.Helper.HopCheck, "guard": res.Helper.Guard, "writes": res.Helper.Calls, "replaced_ranges": len(res.Helper.Replaced), "helper": res.Binary, "standby": res.Standby, "preloaded": res.Preloaded, "precopied_vmas": res.Helper.PreCopiedVMAs,
		"consolidated": res.Helper.Hopped, "consolidated_bytes": res.Helper.HopBytes})
	if res.Helper.FilterErr != "" {
		l = l.WithField("guard_filters_unread", res.Helper.FilterErr)
	}
	if res.Helper.Unguardable > 0 {
		// Correct, not free: that memory stays anonymous, a copy per fork.
		l = l.WithField("unguardable_vmas_left_anonymous", res.Helper.Unguardable)
	}
	if res.Helper.HopErr != "" {
		l = l.WithField("consolidation_refused", res.Helper.HopErr)
	}
	if len(res.NoNewPrivs) > 0 {
		l = l.WithField("no_new_privs", res.NoNewPrivs)
	}
	if err != nil {
		l.WithError(err).Warn("lazyfork: move onto memory file incomplete")
		return
	}
	l.Info("lazyfork: moved onto memory file")
}

// Consolidation (rehome.Fragments): a container that writes pages spread
// over its moved heap gets a patch mapping per island of written pages at
// each move, and its heap becomes thousands of mappings, in it and in every
// fork restored from its dumps (about 400 bytes of kernel memory each per
// copy, and microseconds each in every dump and move). Once a container's
// moves fragment it enough (below), its next Pause (before the freeze: the
// container runs) prepares a consolidation: a new file holding its
// fragmented regions as it sees them, copied from the family's files (they
// never change) by the helper in its memory cgroup, within half its limit's
// headroom (cgroup v1; on v2 the helper could not join it, and nothing is
// prepared). The checkpoint's move maps each region whole from that file,
// with the pages written since on top, and its dump and forks see one
// mapping; the old pieces are freed in the same call when nothing else maps
// them. A prepared file stays a temporary file of the store (flocked by
// this shim: GC removes it if the shim dies) until that move publishes it,
// and is dropped after preparedTTL unused (a pause no checkpoint followed).
//
// A consolidation copies whole regions (a heap) to save the mappings
// patches made, and the regions' old files stay for as long as an earlier
// snapshot or fork maps them: a copy of the heap for about 800 bytes of
// kernel memory per patch per copy (two mappings). So it is a bound, not a
// routine: once a container's moves made consolidateAfter patches since the
// last one (2 MiB of single pages written spread over its heap; an
// interpreter's ~65 patches per call get there after some eight forks, a
// parent whose writes come in runs hardly ever). That holds the parent near
// 1,150 mappings and each fork's mapping overhead near 0.45 MB, and the
// pause's per-mapping cost with them (about 40 us a mapping: CRIU's dump,
// the plan's smaps and the move's mmaps): with 256 pages written spread per
// call, 2048 let the pause reach 212-245 ms before the consolidating call,
// 1024 191-211 ms, and 768 (the fourth call consolidating) 200-253 ms on a
// slower host, where 512 (the third) kept it under 200 ms with the standby
// helper (standbyHelper); about 100 ms at a few mappings.
//
// A call that makes many forks is different: each fork maps what the dump
// leaves, so the patches count once per fork. When the client said how many
// (lazyforkv1.SnapshotIntent, through Update) and the patches times the
// forks reach consolidateAfter, the call consolidates early, but only when
// the container holds its files alone (heldAlone): then the copy replaces
// the pieces, which are freed, and costs nothing that stays. (With 580
// patches, a hundred forks of a 256 MiB heap held 22 MB more kernel memory
// than forks of one mapping.)
const (
	consolidateAfter = 512
	consolidateAbove = 128 // pieces of fragmented regions in one process
	preparedTTL      = 10 * time.Minute
	// intentTTL bounds how long a snapshot intent waits for its Pause,
	// which the client sends right after it (a call that failed in between
	// leaves it to expire).
	intentTTL = 10 * time.Second
)

type preparedHop struct {
	pf      *memfile.PendingFile
	regions []movehelper.Region
	timer   *time.Timer
	linked  bool
	kept    bool // mapped by the container: sealed, recorded in its state
	// chargedTo is the memory cgroup the preparation wrote the file from.
	chargedTo string
}

type moveNote struct {
	pid     int
	patches int // made since the last consolidation
	moved   bool
	// forks the next Pause's snapshot is for (a client's SnapshotIntent),
	// told at intentAt.
	forks    int
	intentAt time.Time
	// patched: its last snapshot left it on its files (patched.go); prev
	// are that snapshot's patches, private the bytes its dump held.
	patched bool
	prev    []memfile.Patch
	private int64
}

var (
	consolidation sync.Mutex
	preparedHops  = map[string]*preparedHop{}
	moveNotes     = map[string]*moveNote{}
)

// dropConsolidation forgets a container's consolidation state and removes
// a prepared file it did not use (for the container's release; without it a
// prepared file goes after preparedTTL).
func dropConsolidation(ns, id string) {
	key := ns + "/" + id
	consolidation.Lock()
	h := preparedHops[key]
	delete(preparedHops, key)
	delete(moveNotes, key)
	consolidation.Unlock()
	if h != nil && h.timer.Stop() {
		h.pf.Abort()
	}
}

// peekPrepared returns the consolidation prepared for a container, if any,
// and leaves it there.
func peekPrepared(key string) *preparedHop {
	consolidation.Lock()
	defer consolidation.Unlock()
	return preparedHops[key]
}

// takePrepared returns the consolidation prepared for a container, if any.
func takePrepared(key string) *preparedHop {
	consolidation.Lock()
	defer consolidation.Unlock()
	h := preparedHops[key]
	delete(preparedHops, key)
	if h != nil && !h.timer.Stop() {
		return nil // expired and aborted meanwhile
	}
	return h
}

// noteMove records a container's move for the preparation at its next Pause.
func noteMove(key string, pid, patches int, consolidated bool) {
	consolidation.Lock()
	defer consolidation.Unlock()
	n := moveNotes[key]
	if n == nil || consolidated {
		n = &moveNote{}
		moveNotes[key] = n
	}
	if n.patched {
		// Its patches were its forks'; its own start now.
		n.patched, n.prev, n.private, n.patches = false, nil, 0, 0
	}
	n.pid, n.moved = pid, true
	n.patches += patches
}

// finish seals a prepared file the move mapped (or may have: its helper
// failed), or drops it.
func (h *preparedHop) finish(ctx context.Context, store *memfile.Store, st *containerState, hopped bool) {
	if hopped {
		if err := h.pf.Seal(); err != nil {
			log.G(ctx).WithError(err).Warn("lazyfork: seal a consolidated memory file")
		}
		if h.chargedTo != "" {
			if err := store.SetCharge(st.Family, h.pf.Name(), h.chargedTo); err != nil {
				log.G(ctx).WithError(err).Warn("lazyfork: record where a consolidated file is charged")
			}
		}
		h.kept = true
		return
	}
	if h.linked {
		os.Remove(filepath.Join(store.ViewDir(st.View), h.pf.Name()))
	}
	h.pf.Abort()
}

// noteIntent records a client's snapshot intent for the container's next
// Pause. A container that never moved has nothing to consolidate.
func noteIntent(key string, forks int) {
	consolidation.Lock()
	defer consolidation.Unlock()
	if n := moveNotes[key]; n != nil {
		n.forks, n.intentAt = forks, time.Now()
	}
}

// consolidationDue reports whether a container's next snapshot should map a
// consolidation (see consolidateAfter), and whether it is the bound (not a
// many-fork call's): it takes the intent the Pause it runs in was told.
func (s *Service) consolidationDue(st *containerState) (due, bound bool) {
	consolidation.Lock()
	n := moveNotes[st.Namespace+"/"+st.ID]
	forks, pid := 0, 0
	if n != nil {
		pid = n.pid
		if time.Since(n.intentAt) < intentTTL {
			forks = n.forks
		}
		n.forks, n.intentAt = 0, time.Time{}
	}
	bound = n.due()
	many := !bound && n.dueFor(forks)
	consolidation.Unlock()
	if bound {
		return true, true
	}
	if !many {
		return false, false
	}
	store, err := s.Store()
	if err != nil {
		return false, false
	}
	pids := []int{pid}
	if freezer, err := freezerCgroup(pid); err == nil {
		if all, err := cgroupProcs(freezer); err == nil && len(all) > 0 {
			pids = all
		}
	}
	dir := filepath.Join(store.Root(), st.Family)
	return heldAlone(store, st, func(file string) bool { return memfile.MappedBy(pids, filepath.Join(dir, file)) }), false
}

// due: moved since the last preparation, with enough patches (nil: never).
func (n *moveNote) due() bool {
	return n != nil && n.moved && (n.patches >= consolidateAfter || n.patched && n.private >= consolidateBytes)
}

// dueFor: worth consolidating for a call of that many forks, the container
// holding its files alone. Its patches, counted once per fork, reach the
// bound, and are enough for its regions to be found fragmented
// (consolidateAbove pieces: a patch inside a mapping adds two).
func (n *moveNote) dueFor(forks int) bool {
	return n != nil && n.moved && forks > 1 && 2*n.patches >= consolidateAbove && n.patches*forks >= consolidateAfter
}

// heldAlone reports whether the container is the only live holder of every
// family file it holds and still maps (mapsNow: its processes map the file;
// it keeps its references to the files it left until it goes): no snapshot
// and no other container (a fork) holds one, so a consolidation frees the
// pieces it replaces.
func heldAlone(store *memfile.Store, st *containerState, mapsNow func(file string) bool) bool {
	holders, err := store.Holders(st.Family)
	if err != nil {
		return false
	}
	mine := map[string]bool{}
	for h, files := range holders {
		if st.ownsHolder(h) {
			for _, f := range files {
				mine[f] = true
			}
		}
	}
	if len(mine) == 0 {
		return false
	}
	shared := map[string]bool{}
	for h, files := range holders {
		if !st.ownsHolder(h) {
			for _, f := range files {
				if mine[f] {
					shared[f] = true
				}
			}
		}
	}
	for f := range shared {
		if mapsNow(f) {
			return false
		}
	}
	return true
}

// prepareConsolidation prepares a consolidation for a container whose moves
// fragment it fast enough (consolidationDue; bound: the routine one, whose
// count starts again when its regions prove not fragmented enough). It runs
// in Pause, before the freeze; failures only cost the consolidation.
func (s *Service) prepareConsolidation(ctx context.Context, st *containerState, bound bool) {
	key := st.Namespace + "/" + st.ID
	consolidation.Lock()
	n := moveNotes[key] // the container's, unless dropped (Delete) meanwhile
	ready := n != nil && n.moved
	pid, patched := 0, false
	if n != nil {
		n.moved = false
		pid, patched = n.pid, n.patched
	}
	consolidation.Unlock()
	if !ready || st.View == "" {
		return
	}
	t0 := time.Now()
	l := log.G(ctx).WithField("id", st.ID)
	freezer, err := freezerCgroup(pid)
	var pids []int
	if err == nil {
		pids, err = cgroupProcs(freezer)
	}
	store, serr := s.Store()
	if err = errors.Join(err, serr); err != nil {
		l.WithError(err).Debug("lazyfork: no consolidation prepared")
		return
	}
	// On cgroup v2 the container's memory cgroup is the frozen one the
	// helper must not join, and a copy from outside it would charge a heap
	// to the shim: no consolidation there.
	if mem, err := memoryCgroupDir(pid); err != nil || mem == freezer {
		l.WithError(err).Debug("lazyfork: no consolidation prepared (cgroup v2: the copy could not be charged to the container)")
		return
	}
	var maxBytes int64
	if path, _, err := procfs.Cgroup(pid, "memory"); err == nil {
		if limit, usage, ok, err := cgroupmem.Limit(path); err == nil && ok {
			// Half the headroom: the container runs meanwhile, and tmpfs
			// pages are not reclaimed under its limit.
			maxBytes = max((limit-usage)/2-2*minMoveChunk, 1)
		}
	}
	pf, err := store.CreateFile(st.Family)
	if err != nil {
		l.WithError(err).Warn("lazyfork: prepare a consolidation")
		return
	}
	req := movehelper.Request{
		Prepare: true, Freezer: freezer, Pids: pids, HostFile: pf.Path(), HostDir: store.ViewDir(st.View),
		MemDir: memfile.MountPath, PrepareAbove: consolidateAbove, MaxBytes: maxBytes,
	}
	if patched {
		// Its writes sit in its mappings, however few (patched.go).
		req.PrepareAbove, req.PrepareWritten = 0, true
	}
	var run helperRun
	reply, err := s.runRehomeHelper(ctx, pid, &req, nil, nil, &run)
	if err == nil && reply.Err != "" {
		err = errors.New(reply.Err)
	}
	if err != nil || len(reply.Regions) == 0 {
		pf.Abort()
		consolidation.Lock()
		if n := moveNotes[key]; n != nil && bound {
			n.patches = 0 // not fragmented enough yet: counted again
		}
		consolidation.Unlock()
		if err != nil {
			l.WithError(err).Warn("lazyfork: prepare a consolidation")
		}
		return
	}
	h := &preparedHop{pf: pf, regions: reply.Regions, chargedTo: req.ChargedTo}
	consolidation.Lock()
	if moveNotes[key] != n {
		// Deleted (and maybe created again) while this copied.
		consolidation.Unlock()
		pf.Abort()
		return
	}
	if old := preparedHops[key]; old != nil && old.timer.Stop() {
		old.pf.Abort()
	}
	preparedHops[key] = h
	h.timer = time.AfterFunc(preparedTTL, func() {
		consolidation.Lock()
		if preparedHops[key] == h {
			delete(preparedHops, key)
		}
		consolidation.Unlock()
		pf.Abort()
	})
	consolidation.Unlock()
	l.WithFields(log.Fields{"regions": len(reply.Regions), "bytes": reply.Prepared, "duration": time.Since(t0)}).Info("lazyfork: consolidation prepared")
}

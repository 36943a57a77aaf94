package shim

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/cgroups/v3"
	"github.com/containerd/cgroups/v3/cgroup1"
	cgroupsv2 "github.com/containerd/cgroups/v3/cgroup2"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	tasktypes "github.com/containerd/containerd/api/types/task"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/oom"
	oomv1 "github.com/containerd/containerd/v2/pkg/oom/v1"
	oomv2 "github.com/containerd/containerd/v2/pkg/oom/v2"
	ptypes "github.com/containerd/containerd/v2/pkg/protobuf/types"
	"github.com/containerd/containerd/v2/pkg/shim"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	"github.com/containerd/typeurl/v2"
	"google.golang.org/protobuf/proto"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/internal/shimaddr"
	"github.com/lazyfork/lazyfork/memfile"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
)

// Service is LazyFork's task service: runc's, with checkpoint rewritten into
// memory files and restore from LazyFork snapshots.
type Service struct {
	// TTRPCTaskService is runc's task service; every RPC not overridden here is
	// runc's own.
	taskAPI.TTRPCTaskService

	ctx       context.Context
	cfg       Config
	publisher shim.Publisher
	self      string // this binary, the OCI hook

	storeMu sync.Mutex
	store   *memfile.Store // opened on first use, guarded by storeMu

	criuEnvOnce sync.Once // CRIU_CONFIG_FILE set for the CRIU runs of this shim
	kerndat     kerndat   // CRIU's kernel-feature cache, checked once per shim

	mu         sync.Mutex
	containers map[string]*container // by container id, guarded by mu
	thawed     map[string]bool       // tasks thawed by a checkpoint, whose next Resume is done; guarded by mu
	frozenAt   map[string]time.Time  // when this shim's Pause of each paused task began freezing it (monotonic); guarded by mu
	// inPlace holds the freezer cgroup of each task this shim froze itself
	// for a snapshot (SnapshotIntent.freeze_in_shim; runc's shim sees it
	// running), until its Resume; guarded by mu.
	inPlace map[string]string
	// freezeIntents: when a client asked that a task's next Pause freeze it
	// in the shim; guarded by mu.
	freezeIntents map[string]time.Time
	oomWatcher    oom.Watcher // for restored tasks, guarded by mu

	trim heapTrimmer

	zeroGuards zeroGuards // per snapshot image: does it carry a zero-mode guard
}

// container is LazyFork's view of one task served by this shim.
type container struct {
	state  containerState
	bundle string
	// cg is the cgroup of a restored task, loaded after Start (runc's shim
	// only loads it for tasks it creates); nil otherwise.
	cg any
	// sup is the madvise supervisor of a task restored from a zero-mode
	// snapshot (nil otherwise, or if it could not attach: then the guarded
	// calls fail with ENOSYS, which allocators treat like a refusal).
	sup *supervisor
}

var (
	_ taskAPI.TTRPCTaskService = (*Service)(nil)
	_ shim.TTRPCService        = (*Service)(nil)
)

// NewService wraps runc's task service.
func NewService(ctx context.Context, runc taskAPI.TTRPCTaskService, publisher shim.Publisher) (*Service, error) {
	cfg, err := ConfigFromEnv()
	if err != nil {
		return nil, err
	}
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("locate shim binary for the OCI hook: %w", err)
	}
	return &Service{
		TTRPCTaskService: runc,
		ctx:              ctx,
		cfg:              cfg,
		publisher:        publisher,
		self:             self,
		containers:       map[string]*container{},
		thawed:           map[string]bool{},
		frozenAt:         map[string]time.Time{},
		inPlace:          map[string]string{},
		freezeIntents:    map[string]time.Time{},
	}, nil
}

// RegisterTTRPC serves this service (not runc's) as the task API.
func (s *Service) RegisterTTRPC(server *ttrpc.Server) error {
	taskAPI.RegisterTTRPCTaskService(server, s)
	return nil
}

// Store opens the family memory store, mounting LazyFork's tmpfs first if needed.
func (s *Service) Store() (*memfile.Store, error) {
	s.storeMu.Lock()
	defer s.storeMu.Unlock()
	if s.store != nil {
		return s.store, nil
	}
	st, err := openStore(s.cfg)
	if err != nil {
		return nil, err
	}
	s.store = st
	return st, nil
}

func openStore(cfg Config) (*memfile.Store, error) {
	if err := memfile.EnsureTmpfs(cfg.Root, cfg.TmpfsSize); err != nil {
		return nil, fmt.Errorf("lazyfork tmpfs at %s: %w", cfg.Root, err)
	}
	st, err := memfile.OpenStore(cfg.MemRoot())
	if err != nil {
		return nil, fmt.Errorf("open memory store %s: %w", cfg.MemRoot(), err)
	}
	return st, nil
}

// Create prepares the bundle for LazyFork (memory-directory mount, overcommit
// hook, family reference) and then lets runc's shim create the task. A create
// from a LazyFork snapshot is only recorded; runc restores it at Start.
func (s *Service) Create(ctx context.Context, r *taskAPI.CreateTaskRequest) (_ *taskAPI.CreateTaskResponse, retErr error) {
	defer s.trim.begin()()
	t0 := time.Now()
	c, err := s.prepare(ctx, r)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	defer func() {
		if retErr != nil {
			if err := s.release(ctx, c); err != nil {
				log.G(ctx).WithError(err).Warn("lazyfork: release after failed create")
			}
		}
	}()
	t1 := time.Now()
	if c.state.Snapshot == "" {
		warmCgroupAttach(ctx) // runc create moves its init into the cgroups (a fork's restore runs at Start)
	}
	resp, err := s.TTRPCTaskService.Create(ctx, r)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.containers[r.ID] = c
	s.mu.Unlock()
	log.G(ctx).WithFields(log.Fields{"id": r.ID, "prepare": t1.Sub(t0), "runc_create": time.Since(t1)}).Debug("lazyfork: created")
	return resp, nil
}

func (s *Service) prepare(ctx context.Context, r *taskAPI.CreateTaskRequest) (_ *container, retErr error) {
	ns, err := namespaces.NamespaceRequired(ctx)
	if err != nil {
		return nil, err
	}
	if r.Options, err = createOptions(r.Options); err != nil {
		return nil, err
	}
	spec, err := readSpec(r.Bundle)
	if err != nil {
		return nil, err
	}
	if r.Options, err = s.cfg.privateStack(r.Options, spec, ns, r.ID); err != nil {
		return nil, err
	}
	store, err := s.Store()
	if err != nil {
		return nil, err
	}
	c := &container{
		bundle: r.Bundle,
		state: containerState{
			Namespace:    ns,
			ID:           r.ID,
			Madvise:      spec.Annotations[api.AnnotationMadvise],
			PodNamespace: spec.Annotations[annotationCRISandboxNamespace],
			Forkable:     forkable(spec.Annotations),
			Rehome:       spec.Annotations[api.AnnotationRehome],
		},
	}
	if spec.Linux != nil {
		c.state.CgroupsPath = spec.Linux.CgroupsPath
	}
	// From here on, what c.state records is released on error.
	defer func() {
		if retErr != nil {
			if err := releaseContainer(ctx, s.cfg, &c.state); err != nil {
				log.G(ctx).WithError(err).WithField("id", r.ID).Warn("lazyfork: release after failed prepare")
			}
		}
	}()
	if _, _, err := parseMadvise(c.state.Madvise); err != nil {
		return nil, fmt.Errorf("annotation %s: %w", api.AnnotationMadvise, err)
	}
	if v := c.state.Rehome; v != "" && v != "true" && v != "false" && v != api.RehomeEachSnapshot {
		return nil, fmt.Errorf("annotation %s=%q: want true, false or %s: %w", api.AnnotationRehome, v, api.RehomeEachSnapshot, errdefs.ErrInvalidArgument)
	}
	byAnnotation := false
	if ref := forkOf(spec.Annotations); ref != "" && r.Checkpoint == "" {
		// A fork as a pod: CRI cannot restore, so the container names its
		// snapshot in an annotation and runc restores it at Start.
		byAnnotation = true
		var dir string
		if filepath.IsAbs(ref) {
			if err := s.cfg.checkForkOfPath(ref); err != nil {
				return nil, err
			}
			dir, c.state.Unpacked, err = resolveForkOf(s.cfg, ns, r.ID, ref)
		} else {
			dir, c.state.Unpacked, err = s.snapshotRunning(ctx, ns, ref, c.state.PodNamespace, mount.FromProto(r.Rootfs))
		}
		if err != nil {
			return nil, err
		}
		r.Checkpoint = dir
	}
	var snap *memfile.SnapshotInfo
	if r.Checkpoint != "" {
		snap, err = memfile.ReadSnapshot(r.Checkpoint)
		switch {
		case errdefs.IsNotFound(err) && !byAnnotation:
			snap = nil // a plain CRIU image: runc restores it as runc would
		case err != nil:
			return nil, fmt.Errorf("read LazyFork snapshot %s: %w", r.Checkpoint, err)
		}
	}
	// CRIU's kernel probes, once per boot. Any restore waits (a plain CRIU
	// image's too): on a host whose breakpoints do not trap, CRIU must not
	// start before CRIU_FAULT is set.
	s.kerndat.ensure(ctx, s.self, r.Checkpoint != "")
	if snap != nil {
		// Before anything of the parent reaches this container: its memory
		// files, its writable layer.
		if err := authorizeRestore(store, ns, spec.Annotations, byAnnotation, r.Checkpoint, snap); err != nil {
			return nil, err
		}
		c.state.Family = snap.Family
		if err := store.Verify(snap.Family, snap.Files); err != nil {
			return nil, fmt.Errorf("snapshot %s: %w (%s)", r.Checkpoint, err, hintFilesGone)
		}
		c.state.Snapshot = r.Checkpoint
		c.state.Holder = containerHolder(ns, r.ID)
		// Tied to the bundle: if this shim dies before the task exists, its
		// delete may find the bundle already gone and drop nothing; GC
		// drops it once the bundle is gone.
		if err := store.RefBundle(snap.Family, c.state.Holder, r.Bundle, snap.Files); err != nil {
			return nil, fmt.Errorf("reference memory files of %s: %w", r.Checkpoint, err)
		}
	} else {
		// Dropped on delete, as a fork's, or by GC once the bundle is gone.
		c.state.Holder = containerHolder(ns, r.ID)
		if c.state.Family, err = claimRootFamily(store, ns, r.ID, c.state.Holder, r.Bundle); err != nil {
			return nil, err
		}
	}
	if f := spec.Annotations[api.AnnotationFamily]; f != "" && f != c.state.Family {
		log.G(ctx).WithFields(log.Fields{"id": r.ID, "annotation": f, "family": c.state.Family}).Warn("lazyfork: family annotation ignored")
	}
	if byAnnotation {
		// CRI prepared the image's rootfs; the parent's writable layer goes
		// on top of it before runc mounts it (a running parent's already has).
		ref := forkOf(spec.Annotations)
		switch {
		case c.state.Unpacked != "" && filepath.IsAbs(ref):
			applied, err := applyRootfsDiff(ctx, ref, mount.FromProto(r.Rootfs))
			if err != nil {
				return nil, fmt.Errorf("annotation %s: checkpoint archive %s: %w", api.AnnotationForkOf, ref, err)
			}
			log.G(ctx).WithFields(log.Fields{"id": r.ID, "rootfs_diff": applied}).Debug("lazyfork: fork-of archive")
		case c.state.Unpacked == "":
			copied, err := s.copySnapshotLayer(ctx, ns, r.Checkpoint, mount.FromProto(r.Rootfs))
			if err != nil {
				return nil, fmt.Errorf("annotation %s: snapshot %s: %w", api.AnnotationForkOf, r.Checkpoint, err)
			}
			log.G(ctx).WithFields(log.Fields{"id": r.ID, "layer": copied}).Debug("lazyfork: fork-of snapshot")
		}
	}
	// The container sees only its own lineage's files, never its family's
	// directory (where its relatives' later snapshots land).
	var files []string
	if snap != nil {
		files = snap.Files
	}
	view := memfile.ViewName(ns, r.ID)
	c.state.View = view
	viewDir, err := store.LinkView(c.state.Family, view, files)
	if err != nil {
		return nil, fmt.Errorf("memory view of %s: %w", r.ID, err)
	}
	withMemMount(spec, viewDir)
	if s.cfg.Overcommit != "" {
		if err := ensureOvercommitFile(viewDir, s.cfg.Overcommit); err != nil {
			return nil, fmt.Errorf("overcommit file: %w", err)
		}
		withOvercommitHook(spec, s.self, r.Bundle, s.cfg.Overcommit)
	}
	if s.cfg.CRIUVerbosity != "" {
		// Only a LazyFork snapshot's restore leaves cgroups to runc: a plain
		// CRIU image is restored as runc would (Start puts the line back
		// out for a snapshot; Checkpoint checks before every dump).
		conf, err := writeCRIUConfig(r.Bundle, s.cfg.Root, s.cfg.CRIUVerbosity, snap != nil && s.zeroGuards.of(ctx, r.Checkpoint),
			snap != nil && cgroupsLeftToRunc(spec))
		if err != nil {
			return nil, fmt.Errorf("CRIU configuration: %w", err)
		}
		withCRIUConfig(spec, conf, s.cfg.Root)
		s.criuEnvOnce.Do(func() {
			if err := setCRIUEnvConfig(s.cfg.Root); err != nil {
				log.G(ctx).WithError(err).Warn("lazyfork: CRIU configuration (CRIU_CONFIG_FILE): dumps keep CRIU's iptables network lock")
			}
		})
	}
	if err := writeSpec(r.Bundle, spec); err != nil {
		return nil, err
	}
	if err := writeState(r.Bundle, &c.state); err != nil {
		return nil, err
	}
	// Recorded as this container's: from here on its release removes it.
	if err := claimSnapshot(s.cfg, c.state.Unpacked); err != nil {
		return nil, err
	}
	log.G(ctx).WithFields(log.Fields{"id": r.ID, "family": c.state.Family, "snapshot": c.state.Snapshot}).Debug("lazyfork: container prepared")
	return c, nil
}

// release drops what prepare took: the memory-file reference and any cgroup a
// failed restore left.
func (s *Service) release(ctx context.Context, c *container) error {
	return releaseContainer(ctx, s.cfg, &c.state)
}

func releaseContainer(ctx context.Context, cfg Config, st *containerState) error {
	dropConsolidation(st.Namespace, st.ID)
	left := false
	if st.Snapshot != "" {
		left = !unmountRestoreLeftovers(ctx, st.Namespace, st.ID)
		left = !removeCgroup(ctx, st.CgroupsPath) || left
	}
	err := releaseMemory(ctx, cfg, st)
	if err == nil && left {
		// Not released: the shim binary's delete (containerd runs it
		// next) tries again.
		err = fmt.Errorf("%s: a failed restore left mounts or cgroups that are still busy", st.ID)
	}
	return err
}

// releaseMemory drops what a container holds in its family: its references
// (and its unpacked checkpoint's), its view.
func releaseMemory(ctx context.Context, cfg Config, st *containerState) error {
	holders := []string{st.Holder, exportHolder(st.Namespace, st.ID)}
	for _, f := range st.MovedFiles {
		holders = append(holders, movedHolder(st.Namespace, st.ID, f))
	}
	if st.Unpacked != "" {
		// A snapshot of a running parent holds its files as any kept snapshot.
		holders = append(holders, memfile.HolderSnapshot+api.ImageDir(st.Unpacked))
		// Only ever a directory this shim made under ROOT/snapshots.
		if filepath.Dir(st.Unpacked) == api.Root(cfg.Root).Snapshots() {
			if err := os.RemoveAll(st.Unpacked); err != nil {
				log.G(ctx).WithError(err).Warn("lazyfork: remove unpacked checkpoint")
			}
		}
		st.Unpacked = ""
	}
	if st.Family == "" && st.View == "" {
		return nil
	}
	store, err := memfile.OpenStore(cfg.MemRoot())
	if err != nil {
		return err
	}
	if st.View != "" {
		if err := store.RemoveView(st.View); err != nil {
			return fmt.Errorf("remove memory view of %s: %w", st.ID, err)
		}
		st.View = ""
	}
	if st.Family == "" {
		return nil
	}
	drop := map[string]bool{}
	for _, h := range holders {
		if h != "" {
			drop[h] = true
		}
	}
	patches := patchesHolder(st.Namespace, st.ID, "")
	// One pass over the family's references: a family of many forks has
	// many, and a delete would otherwise read them once a holder.
	if err := store.UnrefMatching(st.Family, func(h string) bool {
		return drop[h] || strings.HasPrefix(h, patches)
	}); err != nil && !errdefs.IsNotFound(err) {
		return fmt.Errorf("unref %s's references in family %s: %w", st.ID, st.Family, err)
	}
	st.Holder, st.MovedFiles = "", nil
	dropFamilyRecord(cfg, st.Family)
	return nil
}

// dropFamilyRecord removes ROOT/families/<family>.json (recordCharge) once the
// store has removed the family with its last file and holder.
func dropFamilyRecord(cfg Config, family string) {
	if _, err := os.Lstat(filepath.Join(cfg.MemRoot(), family)); errors.Is(err, os.ErrNotExist) {
		_ = os.Remove(api.Root(cfg.Root).FamilyRecord(family))
	}
}

func (s *Service) get(id string) *container {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.containers[id]
}

// Start starts a task; for a task created from a LazyFork snapshot that is the
// CRIU restore. runc's shim neither loads a restored task's cgroup nor watches
// it for OOM; LazyFork does both.
func (s *Service) Start(ctx context.Context, r *taskAPI.StartRequest) (*taskAPI.StartResponse, error) {
	defer s.trim.begin()()
	t0 := time.Now()
	c := s.get(r.ID)
	restoring := r.ExecID == "" && c != nil && c.state.Snapshot != ""
	var timedOut func() bool
	if restoring || r.ExecID != "" {
		// runc's restore moves CRIU, and runc exec its process, into the
		// task's cgroups.
		warmCgroupAttach(ctx)
	}
	if restoring {
		var stop func()
		stop, timedOut = s.boundRestore(ctx, r.ID, c.state.CgroupsPath)
		defer stop()
	}
	resp, err := s.TTRPCTaskService.Start(ctx, r)
	if !restoring {
		return resp, err
	}
	// Its dumps record its cgroups again (criuConfig).
	if cerr := restoreDone(c.bundle); cerr != nil {
		log.G(ctx).WithError(cerr).WithField("id", r.ID).Warn("lazyfork: CRIU configuration after the restore: its dumps may not record its cgroups")
	}
	log.G(ctx).WithFields(log.Fields{"id": r.ID, "restore": time.Since(t0)}).Debug("lazyfork: restored")
	if err == nil && timedOut() {
		// The restore finished as the timer fired: what it made was killed.
		err = errgrpc.ToGRPC(fmt.Errorf("restore of %s: %w", r.ID, context.DeadlineExceeded))
	}
	if err != nil {
		// A CRIU that died mid-restore leaves its cgroup yard mounted in
		// the work directory, which containerd then tries to delete.
		unmountRestoreLeftovers(ctx, c.state.Namespace, r.ID)
		if timedOut() {
			err = errgrpc.ToGRPC(fmt.Errorf("restore of %s did not finish within %s (LAZYFORK_RESTORE_TIMEOUT); its processes were killed; CRIU's log: %s: %w",
				r.ID, s.cfg.RestoreTimeout, filepath.Join(c.bundle, "work", "restore.log"), context.DeadlineExceeded))
		}
		return nil, withSnapshotHint(restoreError(err, c.bundle))
	}
	t1 := time.Now()
	defer func() {
		log.G(ctx).WithFields(log.Fields{"id": r.ID, "after_restore": time.Since(t1)}).Debug("lazyfork: started")
	}()
	s.superviseIfZero(ctx, r.ID, c, int(resp.Pid))
	cg, cerr := loadCgroup(int(resp.Pid))
	if cerr != nil {
		log.G(ctx).WithError(cerr).Warn("lazyfork: load cgroup of restored task")
		return resp, nil
	}
	s.mu.Lock()
	c.cg = cg
	s.mu.Unlock()
	s.watchOOM(ctx, r.ID, cg)
	return resp, nil
}

// boundRestore bounds a restore by the configured timeout: when it passes,
// every process in the task's cgroup (runc, CRIU, the half-restored tree) is
// killed, so runc's restore returns and the caller cleans up. A restore of a
// corrupt image can otherwise spin for ever (seen: 10 minutes at 97% CPU).
// The request's own context is left alone: runc's shim hands it to the
// process it starts.
func (s *Service) boundRestore(ctx context.Context, id, cgroupsPath string) (stop func(), timedOut func() bool) {
	var fired atomic.Bool
	timer := time.AfterFunc(s.cfg.RestoreTimeout, func() {
		fired.Store(true)
		n := killCgroup(cgroupsPath)
		log.G(ctx).WithFields(log.Fields{"id": id, "killed": n}).Warn("lazyfork: restore timed out")
	})
	return func() { timer.Stop() }, fired.Load
}

// restoreError adds the end of CRIU's restore log to a failed restore: runc
// only says "criu failed: type RESTORE errno 0", and the log goes with the bundle.
func restoreError(err error, bundle string) error {
	return withCRIULog(err, filepath.Join(bundle, "work", "restore.log"))
}

// withCRIULog appends the last error lines of a CRIU log to err.
func withCRIULog(err error, logPath string) error {
	b, rerr := os.ReadFile(logPath)
	if rerr != nil {
		return err
	}
	var errs []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, "Error") {
			errs = append(errs, strings.TrimSpace(l))
		}
	}
	if len(errs) > 3 {
		errs = errs[len(errs)-3:]
	}
	if len(errs) == 0 {
		return err
	}
	return errgrpc.ToGRPC(fmt.Errorf("%w; criu: %s", errgrpc.ToNative(err), strings.Join(errs, " | ")))
}

func (s *Service) watchOOM(ctx context.Context, id string, cg any) {
	s.mu.Lock()
	if s.oomWatcher == nil {
		var (
			w   oom.Watcher
			err error
		)
		if cgroups.Mode() == cgroups.Unified {
			w, err = oomv2.New(s.publisher)
		} else {
			w, err = oomv1.New(s.publisher)
		}
		if err != nil {
			s.mu.Unlock()
			log.G(ctx).WithError(err).Warn("lazyfork: OOM watcher")
			return
		}
		s.oomWatcher = w
		go w.Run(s.ctx)
	}
	w := s.oomWatcher
	s.mu.Unlock()
	if err := w.Add(id, cg); err != nil {
		log.G(ctx).WithError(err).Warn("lazyfork: watch restored task for OOM")
	}
}

// Checkpoint dumps the task with runc (leave-running unless runc's options say
// exit), then rewrites the image so its private anonymous memory lives in the
// family's memory files. The rewrite is atomic: on error the image directory
// holds runc's plain image, untouched, and the error says so. (A move refused
// before a dump held at a gate leaves what runc writes before CRIU starts:
// descriptors.json.)
func (s *Service) Checkpoint(ctx context.Context, r *taskAPI.CheckpointTaskRequest) (*ptypes.Empty, error) {
	defer s.trim.begin()()
	if r.Path == "" {
		return nil, errgrpc.ToGRPCf(errdefs.ErrInvalidArgument, "checkpoint of %s: no image path", r.ID)
	}
	opts, keep, err := checkpointOptions(r.Options)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	lf, err := api.LazyForkCheckpointOptions(r.Options)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	if opts.GetOpenTcp() && os.Getenv("CRIU_CONFIG_FILE") == filepath.Join(s.cfg.Root, criuEnvConfigName) {
		// Established connections need CRIU's network lock, which
		// LazyFork's CRIU runs leave out (criuEnvConfig).
		return nil, errgrpc.ToGRPCf(errdefs.ErrNotImplemented,
			"checkpoint of %s: LazyFork snapshots do not keep established TCP connections (CRIU runs without its network lock); checkpoint without --tcp-established", r.ID)
	}
	s.kerndat.ensure(ctx, s.self, true)
	if !keep {
		// runc's shim only understands its own options; none means leave-running.
		a, err := typeurl.MarshalAnyToProto(opts)
		if err != nil {
			return nil, errgrpc.ToGRPC(err)
		}
		r.Options = a
	}
	st, err := s.stateOf(ctx, r.ID)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	ts, err := s.State(ctx, &taskAPI.StateRequest{ID: r.ID})
	if err != nil {
		return nil, err
	}
	// A dump that ignored cgroups would put a plain restore of it back
	// into this container's cgroups (criuConfig).
	if err := restoreDone(ts.Bundle); err != nil {
		return nil, errgrpc.ToGRPC(fmt.Errorf("checkpoint of %s: CRIU configuration: %w", r.ID, err))
	}
	// runc's shim mounts the container's rootfs at bundle/rootfs.
	ropts := memfile.RewriteOptions{Family: st.Family, MapDir: memfile.MountPath, FileRoot: filepath.Join(ts.Bundle, "rootfs")}
	// CRIU drops MADV_WIPEONFORK: read it from the tree before the dump and,
	// unless the task is frozen (nothing changes then), after it too.
	t0 := time.Now()
	frozen := ts.Status == tasktypes.Status_PAUSED // this shim's State: a freeze of its own too
	s.mu.Lock()
	frozenAt := s.frozenAt[r.ID] // a frozen task's last Pause
	s.mu.Unlock()
	mode, guard, err := s.madviseOf(st)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	rehome := s.rehomeEnabled(st, mode, guard)
	patchesCharged := "" // where a patched snapshot's new file is charged (copyPatchesCharged)
	move := frozen && rehome
	key := st.Namespace + "/" + st.ID
	if rehome && s.patchesDeltas(st) && len(st.MovedFiles) > 0 {
		// It runs on its files: unless a consolidation is due, it stays
		// there and its forks get its writes as patches (patched.go).
		if prev, moveDue := patchedNext(key); !moveDue || !move {
			ropts.Patch = &memfile.PatchOptions{Previous: prev, Copy: s.copyPatchesCharged(int(ts.Pid), &patchesCharged)}
			move = false
		}
	}
	// A move's plan reads them (the task is frozen, and wipe-on-fork
	// mappings never move): a second read of every smaps would run beside
	// it on the pause's CPUs. Without a move, or where its plan did not
	// cover the tree, they are read here.
	var tWipe time.Duration
	wipeFromMove := false
	if !move {
		ropts.WipeOnFork = readWipeOnFork(ctx, int(ts.Pid), nil)
		tWipe = time.Since(t0)
	}
	// A frozen container moves onto a memory file first: its heap is then
	// held once, and the dump below sees file mappings and holds only what
	// it wrote since (the delta path of a fork of a fork).
	var tMove time.Duration
	var preCopyFrozen time.Duration // the freeze of a precopy the move took, before this one
	// What the move replaced is freed once the task runs again (or the
	// checkpoint failed), off the pause; Checkpoint returns after. (It
	// holds the family's lock, as the rewrite's new file and commit do, so
	// the two mostly take turns.)
	var replaced []memfile.FileRange
	freeReplaced := sync.OnceValue(func() chan struct{} {
		done := make(chan struct{})
		go func() {
			defer close(done)
			s.freeReplaced(context.WithoutCancel(ctx), st, replaced)
		}()
		return done
	})
	defer func() { <-freeReplaced() }()
	// A later move (a delta) starts runc now, held back before CRIU until
	// the move is over (dumpgate.go): its start-up leaves the pause.
	var early *earlyDump
	if move && len(st.MovedFiles) > 0 && !opts.GetExit() {
		early = s.startEarlyDump(ctx, r)
	} else {
		removeStaleGate(r.ID)
	}
	defer early.close()
	if move {
		res, err := s.rehomeContainer(ctx, st, int(ts.Pid), mode, guard)
		tMove, preCopyFrozen = res.Duration, res.PreCopyFrozen
		if err == nil {
			for _, r := range res.Helper.Replaced {
				replaced = append(replaced, memfile.FileRange{File: r.File, Off: r.Off, Len: r.Len})
			}
		}
		if errdefs.IsResourceExhausted(err) && res.VMAs == 0 {
			// Its memory limit bounds its snapshots: no dump charged
			// elsewhere behind its back.
			return nil, errgrpc.ToGRPC(fmt.Errorf("checkpoint of %s: %w", r.ID, err))
		}
		t1 := time.Now()
		if ropts.WipeOnFork, wipeFromMove = memfile.WipeOnForkOf(int(ts.Pid), res.Helper.WipeOnFork); !wipeFromMove {
			ropts.WipeOnFork = readWipeOnFork(ctx, int(ts.Pid), nil)
		}
		tWipe = time.Since(t1)
		logRehome(ctx, r.ID, res, err)
		if res.File != "" {
			st.MovedFiles = append(st.MovedFiles, res.File)
			s.recordState(ctx, r.ID, ts.Bundle, st)
		}
	}
	// CRIU cannot dump a traced task: a zero-mode supervisor lets go for the
	// dump (Pause already did, for a frozen task). A running supervised task
	// (a bare task-service checkpoint: containerd's client pauses first) is
	// held and frozen as Pause does, so that it runs no guarded call
	// untraced before CRIU's freeze or after its thaw, and resumed after.
	sup := s.supervisorOf(r.ID)
	pausedHere := false
	if !frozen && sup.isAttached() {
		if _, err := s.pause(ctx, &taskAPI.PauseRequest{ID: r.ID}); err != nil {
			return nil, fmt.Errorf("checkpoint of %s: pause the supervised task for its dump: %w", r.ID, err)
		}
		pausedHere = true
	}
	resumeHere := func() {
		if !pausedHere || opts.GetExit() {
			return
		}
		if _, err := s.Resume(ctx, &taskAPI.ResumeRequest{ID: r.ID}); err != nil {
			log.G(ctx).WithError(err).WithField("id", r.ID).Warn("lazyfork: resume after checkpoint")
		}
	}
	detached, err := sup.detach()
	if err != nil {
		resumeHere()
		return nil, errgrpc.ToGRPC(fmt.Errorf("checkpoint of %s: %w", r.ID, err))
	}
	t1 := time.Now()
	err = s.dump(ctx, r, early)
	resumeHere() // attaches the supervisor again, then thaws
	if err != nil {
		if detached {
			sup.attach(ctx)
		}
		return nil, withSocketOptHint(withCRIULog(err, filepath.Join(ts.Bundle, "criu-dump.log")))
	}
	tDump := time.Since(t1)
	var thawed time.Time
	if !opts.GetExit() {
		if !frozen && !pausedHere {
			ropts.WipeOnFork = readWipeOnFork(ctx, int(ts.Pid), ropts.WipeOnFork)
		}
		if detached {
			sup.attach(ctx)
		}
		if frozen && lf.GetThawAfterDump() {
			thawed = s.thawBeforeRewrite(ctx, r.ID)
		}
	}
	tThawed := time.Since(t0)
	freeReplaced()
	store, err := s.Store()
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	if opts.GetImagePath() == "" {
		// containerd checkpoints into a temporary directory and exports it to
		// its content store (ctr and nerdctl without an image path, CRI): that
		// directory dies at once, so the container itself pins the exported
		// snapshots' files until it is deleted.
		ropts.Holder = exportHolder(st.Namespace, st.ID)
	}
	famDir, err := store.FamilyDir(st.Family)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	src := &api.SnapshotSource{Namespace: st.Namespace, Container: st.ID, Family: st.Family,
		PodNamespace: st.PodNamespace, Forkable: st.Forkable, Taken: time.Now().UTC()}
	if !thawed.IsZero() {
		src.Thawed = thawed.UTC()
		if frozen && !frozenAt.IsZero() {
			// Both monotonic; a precopy's freeze is the container's too.
			src.Paused = thawed.Sub(frozenAt) + preCopyFrozen
		}
	}
	// The source record and the guard go into the staged image, so the
	// snapshot appears with them or not at all; only restored copies carry
	// the guard.
	ropts.Stage = func(_ context.Context, staging string) error {
		if err := writeSource(staging, src); err != nil {
			return fmt.Errorf("record source: %w", err)
		}
		if !guard {
			return nil
		}
		rs, err := madvguard.DataRanges(staging, memfile.MountPath, famDir)
		if err != nil {
			return fmt.Errorf("madvise guard ranges: %w", err)
		}
		return madvguard.ApplyMode(staging, rs, mode)
	}
	res, err := store.Rewrite(ctx, r.Path, ropts)
	if errdefs.IsAborted(err) && ropts.Patch != nil && len(ropts.Patch.Previous) > 0 {
		// A previous patch's file was freed meanwhile: patch anew.
		ropts.Patch = &memfile.PatchOptions{Copy: ropts.Patch.Copy}
		res, err = store.Rewrite(ctx, r.Path, ropts)
	}
	if err != nil {
		return nil, errgrpc.ToGRPC(fmt.Errorf("lazyfork: rewrite checkpoint %s of %s into family %s (the directory keeps runc's plain image): %w", r.Path, r.ID, st.Family, err))
	}
	if err := recordCharge(s.cfg.Root, st.Family); err != nil {
		log.G(ctx).WithError(err).Warn("lazyfork: record family")
	}
	if res.NewFile != "" {
		chargedTo := selfMemoryCgroup()
		if patchesCharged != "" {
			// Its patches, written from its memory cgroup (new anonymous
			// mappings and .data the rewrite converted beside them are
			// the shim's).
			chargedTo = patchesCharged
		}
		if err := store.SetCharge(st.Family, res.NewFile, chargedTo); err != nil {
			log.G(ctx).WithError(err).Warn("lazyfork: record where a memory file is charged")
		}
	}
	if ropts.Patch != nil && !opts.GetExit() {
		notePatched(key, int(ts.Pid), res)
		if err := holdPatches(store, st, res); err != nil {
			log.G(ctx).WithError(err).Warn("lazyfork: hold the patches of a snapshot for the next one")
		}
	} else if move {
		// Moved: its writes are in its own mappings now.
		if err := dropPatchHolders(store, st, ""); err != nil {
			log.G(ctx).WithError(err).Warn("lazyfork: drop the patches a moved container held")
		}
	}
	if move && !opts.GetExit() {
		// Its next snapshot's helper waits, started now (standbyHelper).
		s.startStandbyHelper(ctx)
	}
	log.G(ctx).WithFields(log.Fields{
		"id": r.ID, "family": st.Family, "files": len(res.Files),
		"pages_moved": res.PagesMoved, "pages_kept": res.PagesKept, "rebased": res.Rebased,
		"patched": ropts.Patch != nil, "patches": len(res.Patches), "pages_reused": res.PagesReused,
		"pages_wiped": res.PagesWiped, "duration": res.Duration, "madvise_guard": guardName(guard, mode),
		"wipe_read": tWipe, "wipe_from_move": wipeFromMove, "move": tMove, "dump": tDump, "dump_gated": early.wentOn(), "until_thaw": tThawed,
		"precopy_frozen": preCopyFrozen, "paused": src.Paused,
	}).Info("lazyfork: checkpoint rewritten")
	return &ptypes.Empty{}, nil
}

// recordState keeps a container's changed state: in this shim's view of it
// and in its bundle, for the delete subcommand and later shims.
func (s *Service) recordState(ctx context.Context, id, bundle string, st *containerState) {
	s.mu.Lock()
	if c := s.containers[id]; c != nil {
		c.state = *st
	}
	s.mu.Unlock()
	if err := writeState(bundle, st); err != nil {
		log.G(ctx).WithError(err).WithField("id", id).Warn("lazyfork: record state")
	}
}

// readWipeOnFork adds the wipe-on-fork ranges of the tree at pid to w. A
// failure costs the copies that memory's wipe, not the checkpoint: it is
// logged.
func readWipeOnFork(ctx context.Context, pid int, w memfile.WipeOnFork) memfile.WipeOnFork {
	more, err := memfile.ReadWipeOnFork(pid)
	if err != nil {
		log.G(ctx).WithError(err).Warn("lazyfork: read MADV_WIPEONFORK ranges; copies keep the parent's bytes there")
	}
	return w.Merge(more)
}

// stateOf returns LazyFork's state of a container this shim serves.
func (s *Service) stateOf(ctx context.Context, id string) (*containerState, error) {
	if c := s.get(id); c != nil {
		st := c.state
		return &st, nil
	}
	resp, err := s.TTRPCTaskService.State(ctx, &taskAPI.StateRequest{ID: id})
	if err != nil {
		return nil, errgrpc.ToNative(err)
	}
	st, err := readState(resp.Bundle)
	if err != nil {
		return nil, err
	}
	if st == nil {
		return nil, fmt.Errorf("container %s has no LazyFork state: %w", id, errdefs.ErrFailedPrecondition)
	}
	return st, nil
}

// Delete deletes a task (or exec) with runc's shim; a deleted task's reference
// on its memory files is dropped.
func (s *Service) Delete(ctx context.Context, r *taskAPI.DeleteRequest) (*taskAPI.DeleteResponse, error) {
	defer s.trim.begin()()
	resp, err := s.TTRPCTaskService.Delete(ctx, r)
	if err != nil || r.ExecID != "" {
		return resp, err
	}
	s.mu.Lock()
	c := s.containers[r.ID]
	delete(s.containers, r.ID)
	delete(s.thawed, r.ID)
	delete(s.frozenAt, r.ID)
	delete(s.inPlace, r.ID)
	delete(s.freezeIntents, r.ID)
	var sup *supervisor
	if c != nil {
		sup = c.sup
	}
	s.mu.Unlock()
	if c == nil {
		return resp, nil
	}
	sup.close(ctx)
	if err := s.release(ctx, c); err != nil {
		log.G(ctx).WithError(err).WithField("id", r.ID).Warn("lazyfork: release deleted container")
		return resp, nil
	}
	if err := writeState(c.bundle, &c.state); err != nil && !errors.Is(err, os.ErrNotExist) {
		log.G(ctx).WithError(err).Debug("lazyfork: record release")
	}
	// Nothing is left for the `delete` containerd runs next: the front
	// answers it from the bundle.
	if b, err := proto.Marshal(resp); err == nil {
		if err := shimaddr.WriteDeleted(c.bundle, b); err != nil && !errors.Is(err, os.ErrNotExist) {
			log.G(ctx).WithError(err).Debug("lazyfork: record the delete for the front")
		}
	}
	return resp, nil
}

// Stats serves metrics of restored tasks from the cgroup LazyFork loaded; runc's
// shim has none for them.
func (s *Service) Stats(ctx context.Context, r *taskAPI.StatsRequest) (*taskAPI.StatsResponse, error) {
	s.mu.Lock()
	var cg any
	if c := s.containers[r.ID]; c != nil {
		cg = c.cg
	}
	s.mu.Unlock()
	if cg == nil {
		return s.TTRPCTaskService.Stats(ctx, r)
	}
	var stats any
	switch cg := cg.(type) {
	case cgroup1.Cgroup:
		st, err := cg.Stat(cgroup1.IgnoreNotExist)
		if err != nil {
			return nil, errgrpc.ToGRPC(err)
		}
		stats = st
	case *cgroupsv2.Manager:
		st, err := cg.Stat()
		if err != nil {
			return nil, errgrpc.ToGRPC(err)
		}
		stats = st
	default:
		return nil, errgrpc.ToGRPCf(errdefs.ErrNotImplemented, "unsupported cgroup type %T", cg)
	}
	data, err := typeurl.MarshalAny(stats)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return &taskAPI.StatsResponse{Stats: typeurl.MarshalProto(data)}, nil
}

func guardName(guard bool, mode madvguard.Mode) string {
	if !guard {
		return "off"
	}
	return mode.String()
}

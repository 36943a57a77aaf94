// Package shimaddr is the one place that says which shim process serves a
// LazyFork container: the group a container's spec puts it in (runc's
// grouping, with lazyfork.io/shim-group turned into runc's group), the lock
// that serialises the starts of one group, and the socket address containerd's
// pkg/shim gives that group. Both the shim's manager (shim.NewManager) and the
// small front binary containerd runs for `start`
// (cmd/containerd-shim-lazyfork-v1) use it, so they cannot disagree.
//
// It imports the standard library only (and internal/atomicfile, which does
// too): the front must start in a
// millisecond or two, without containerd's client, grpc or protobuf.
package shimaddr

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/lazyfork/lazyfork/internal/atomicfile"
)

// Annotations of a container's OCI spec that decide its shim.
const (
	// AnnotationShimGroup is api.AnnotationShimGroup (a test holds them equal;
	// package api pulls in protobuf, which the front must not link).
	AnnotationShimGroup = "lazyfork.io/shim-group"
	// AnnotationRuncGroup is runc's shim grouping annotation; the manager sets
	// it from AnnotationShimGroup.
	AnnotationRuncGroup = "io.containerd.runc.v2.group"
	// AnnotationCRISandbox groups the containers of a CRI pod; it wins over
	// AnnotationShimGroup.
	AnnotationCRISandbox = "io.kubernetes.cri.sandbox-id"
)

// SpecFile is the bundle's OCI spec.
const SpecFile = "config.json"

// DefaultSocketDir is where containerd's shims put their sockets when
// containerd names no directory: containerd's defaults.DefaultStateDir + "/s".
const DefaultSocketDir = "/run/containerd/s"

// GroupPrefix keeps LazyFork's groups apart from container ids (runc's
// default group is the container's own id).
const GroupPrefix = "lazyfork-group-"

// groupLabels are runc's manager's grouping annotations, in its order
// (cmd/containerd-shim-runc-v2/manager groupLabels).
var groupLabels = [...]string{AnnotationRuncGroup, AnnotationCRISandbox}

// maxIdentifier is containerd's identifiers' maximum length.
const maxIdentifier = 76

// ValidIdentifier reports whether containerd's identifiers.Validate accepts
// s: 1 to 76 characters, runs of [A-Za-z0-9] joined by single [._-].
func ValidIdentifier(s string) bool {
	if len(s) == 0 || len(s) > maxIdentifier {
		return false
	}
	alnum := false // the previous character was alphanumeric
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
			alnum = true
		case c == '.' || c == '_' || c == '-':
			if !alnum {
				return false
			}
			alnum = false
		default:
			return false
		}
	}
	return alnum
}

// GroupID turns a lazyfork.io/shim-group value into runc's group: the name
// itself when it is a short, plain identifier, else a digest of it (a family
// and a snapshot name together may exceed containerd's 76 characters).
func GroupID(group string) string {
	if id := GroupPrefix + group; ValidIdentifier(id) {
		return id
	}
	sum := sha256.Sum256([]byte(group))
	return GroupPrefix + hex.EncodeToString(sum[:16])
}

// ShimGroup returns the runc group that lazyfork.io/shim-group puts a
// container with these annotations in, "" when it puts it in none, and
// whether the spec still has to carry it (runc's manager reads the group from
// the spec). The annotation is honoured only where runc's own grouping
// (io.containerd.runc.v2.group, a CRI sandbox) does not apply; a spec already
// carrying the group it gives (a second `start` of one bundle) keeps it.
func ShimGroup(ann map[string]string) (group string, rewrite bool) {
	g := ann[AnnotationShimGroup]
	if g == "" || ann[AnnotationCRISandbox] != "" {
		return "", false
	}
	id := GroupID(g)
	switch ann[AnnotationRuncGroup] {
	case "":
		return id, true
	case id:
		return id, false
	}
	return "", false
}

// Grouping returns the group whose shim serves container id, as runc's
// manager computes it from the annotations (after ShimGroup's rewrite): its
// first grouping annotation present, else the container's own id.
func Grouping(id string, ann map[string]string) string {
	for _, l := range groupLabels {
		if g, ok := ann[l]; ok {
			return g
		}
	}
	return id
}

// SocketDir returns the directory of the shim sockets: the bootstrap
// parameters' socket_dir, else containerd's default.
func SocketDir(dir string) string {
	if dir == "" {
		return DefaultSocketDir
	}
	return dir
}

// Address is containerd's pkg/shim CreateSocketAddress: the unix socket of
// the shim of group grouping in namespace ns, for the containerd at
// grpcAddress, under socketDir (debug: the shim's debug socket).
func Address(socketDir, grpcAddress, ns, grouping string, debug bool) string {
	path := filepath.Join(grpcAddress, ns, grouping)
	if debug {
		path = filepath.Join(path, "debug")
	}
	d := sha256.Sum256([]byte(path))
	return "unix://" + socketDir + "/" + hex.EncodeToString(d[:])
}

// Spec is a bundle's OCI spec decoded only as far as its annotations; the
// rest is kept byte for byte.
type Spec struct {
	path        string
	doc         map[string]json.RawMessage
	Annotations map[string]string
}

// ReadSpec reads bundle's config.json.
func ReadSpec(bundle string) (*Spec, error) {
	path := filepath.Join(bundle, SpecFile)
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	s := &Spec{path: path, Annotations: map[string]string{}}
	if err := json.Unmarshal(b, &s.doc); err != nil {
		return nil, fmt.Errorf("decode bundle spec %s: %w", path, err)
	}
	if raw, ok := s.doc["annotations"]; ok {
		if err := json.Unmarshal(raw, &s.Annotations); err != nil {
			return nil, fmt.Errorf("decode annotations of bundle spec %s: %w", path, err)
		}
	}
	return s, nil
}

// SetRuncGroup writes group as runc's group annotation into the spec file.
func (s *Spec) SetRuncGroup(group string) error {
	s.Annotations[AnnotationRuncGroup] = group
	raw, err := json.Marshal(s.Annotations)
	if err != nil {
		return err
	}
	s.doc["annotations"] = raw
	out, err := json.Marshal(s.doc)
	if err != nil {
		return err
	}
	return atomicfile.WriteVolatile(s.path, out, 0o600)
}

// ShimGroup is ShimGroup of the spec's annotations.
func (s *Spec) ShimGroup() (group string, rewrite bool) { return ShimGroup(s.Annotations) }

// LockEnv hands a held start lock to the program a process executes (the
// front to the full shim): "FD:GROUP", the lock's descriptor left open across
// the exec. Without it the lock would be free between the front's release and
// the full shim's take, and other starts of the group would find no shim yet
// and run the full shim too.
const LockEnv = "LAZYFORK_SHIM_START_LOCK"

// Lock is a held start lock of one shim group.
type Lock struct {
	f     *os.File
	path  string
	group string
}

// lockPath is the lock file of group's starts.
func lockPath(socketDir, group string) string {
	sum := sha256.Sum256([]byte(group))
	return filepath.Join(socketDir, ".lazyfork-start-"+hex.EncodeToString(sum[:12])+".lock")
}

// LockStart takes an flock for the starts of one shim group, on a file in
// socketDir (SocketDir) that the last holder removes. runc's manager starts a
// second shim for a group when another `shim start` of it has bound the
// socket but not yet listened (it takes the refused connection for a stale
// socket and replaces it): forks of one batch restore at once, so their
// starts are serialised.
func LockStart(socketDir, group string) (*Lock, error) {
	if err := os.MkdirAll(socketDir, 0o711); err != nil {
		return nil, fmt.Errorf("lock the start of shim group %s: %w", group, err)
	}
	path := lockPath(socketDir, group)
	for {
		f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
		if err != nil {
			return nil, fmt.Errorf("lock the start of shim group %s: %w", group, err)
		}
		if err := flock(f); err != nil {
			f.Close()
			return nil, fmt.Errorf("lock the start of shim group %s: %w", group, err)
		}
		// The previous holder may have removed the file after we opened it:
		// then ours is a lock nobody else sees; take the new one.
		if sameFile(int(f.Fd()), path) {
			return &Lock{f: f, path: path, group: group}, nil
		}
		f.Close()
	}
}

// Release removes the lock file and lets the next start of the group go.
func (l *Lock) Release() {
	os.Remove(l.path)
	l.f.Close()
}

// Handoff keeps the lock open across an exec and returns the environment
// entry (LockEnv) that tells the executed shim so (InheritedLock). The
// descriptor handed over is a duplicate without close-on-exec, owned by
// whoever inherits it: l's own stays l's (it closes on the exec), so no
// descriptor ever has two owners that both close it.
func (l *Lock) Handoff() (string, error) {
	fd, _, errno := syscall.Syscall(syscall.SYS_FCNTL, l.f.Fd(), syscall.F_DUPFD, 3)
	if errno != 0 {
		return "", fmt.Errorf("hand over the start lock of shim group %s: %w", l.group, errno)
	}
	return LockEnv + "=" + strconv.Itoa(int(fd)) + ":" + l.group, nil
}

// InheritedLock returns the start lock of group that the process this one
// replaced held and handed over (Handoff), nil if there is none. It takes
// LockEnv out of the environment and keeps the descriptor from any program
// this process starts (a shim daemon holding it would block every later
// start of the group).
func InheritedLock(socketDir, group string) *Lock {
	v, ok := os.LookupEnv(LockEnv)
	if !ok {
		return nil
	}
	os.Unsetenv(LockEnv)
	fds, g, _ := strings.Cut(v, ":")
	fd, err := strconv.Atoi(fds)
	if err != nil || fd < 3 {
		return nil
	}
	// Only a descriptor that is the named group's lock file is ours: a stale
	// variable would name whatever descriptor has that number now.
	path := lockPath(socketDir, g)
	if g == "" || !sameFile(fd, path) {
		return nil
	}
	if g != group {
		syscall.Close(fd) // another group's lock: let it go
		return nil
	}
	syscall.CloseOnExec(fd)
	return &Lock{f: os.NewFile(uintptr(fd), path), path: path, group: group}
}

// sameFile reports whether fd is the file at path.
func sameFile(fd int, path string) bool {
	var held, now syscall.Stat_t
	return syscall.Fstat(fd, &held) == nil && syscall.Stat(path, &now) == nil && held.Ino == now.Ino && held.Dev == now.Dev
}

func flock(f *os.File) error {
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX)
		if err != syscall.EINTR {
			return err
		}
	}
}

// Start is what LazyFork adds to runc's manager's `start` of one container:
// the group whose shim serves it, and that group's start lock. The front
// (for the starts it answers or whose shim it spawns) and the full shim's
// manager both begin a start with PrepareStart, so they cannot disagree.
type Start struct {
	// Group is the group lazyfork.io/shim-group puts the container in, ""
	// when it puts it in none (then there is no lock).
	Group string
	// Grouping is runc's grouping once the group is written (WriteGroup):
	// the shim serving the container is the one of Address(..., Grouping).
	Grouping string
	// Lock is the group's start lock, held; nil when Group is "".
	Lock *Lock

	spec    *Spec
	rewrite bool
}

// PrepareStart reads the spec of bundle, the bundle of container id, and
// takes its group's start lock: the one the process this one replaced handed
// over (InheritedLock), else a new one (LockStart). It writes nothing:
// WriteGroup does, Release frees the lock.
func PrepareStart(bundle, socketDir, id string) (*Start, error) {
	spec, err := ReadSpec(bundle)
	if err != nil {
		return nil, err
	}
	group, rewrite := spec.ShimGroup()
	s := &Start{Group: group, spec: spec, rewrite: rewrite}
	if group != "" {
		// ShimGroup puts a container in a group only where runc's group
		// annotation, once written, will name it and no CRI sandbox does.
		s.Grouping = group
	} else {
		s.Grouping = Grouping(id, spec.Annotations)
	}
	s.Lock = InheritedLock(socketDir, group)
	if s.Lock == nil && group != "" {
		if s.Lock, err = LockStart(socketDir, group); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// WriteGroup writes the group into the bundle's spec as runc's group, where
// it is not there yet: runc's manager (and a later start) read it there.
func (s *Start) WriteGroup() error {
	if !s.rewrite {
		return nil
	}
	if err := s.spec.SetRuncGroup(s.Group); err != nil {
		return fmt.Errorf("set the shim group of bundle spec %s: %w", s.spec.path, err)
	}
	s.rewrite = false
	return nil
}

// Release frees the start lock, if held: the group's next start may go (and
// finds the shim listening, when this start started it).
func (s *Start) Release() {
	if s.Lock != nil {
		s.Lock.Release()
		s.Lock = nil
	}
}

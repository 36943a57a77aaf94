package client

import (
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"strings"

	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

// nerdctl's labels (github.com/containerd/nerdctl/v2/pkg/labels), which it
// also puts in the spec's annotations for its OCI hooks.
const (
	nerdctlPrefix   = "nerdctl/"
	nerdctlStateDir = "nerdctl/state-dir" // <data store>/containers/<ns>/<id>
	nerdctlLogURI   = "nerdctl/log-uri"   // binary:// URI of nerdctl's logging driver
)

// nerdctlStateFiles are the files of a nerdctl container's state directory
// a fork gets copies of: what its mounts bind (resolv.conf, hostname) and
// its logging driver's configuration. The json log, the hooks' logs and
// the lifecycle state are the fork's own.
var nerdctlStateFiles = []string{"resolv.conf", "hostname", "log-config.json"}

// nerdctlFork makes a fork of a nerdctl container a whole nerdctl container:
// its own name (its id, or <parent's name>-<suffix of its id> when the id
// was made up), its own state directory and /etc/hosts (copies of the
// parent's), labels and annotations naming them, so that nerdctl's hooks
// (which acquire and release the name in the annotations), nerdctl ps,
// logs, exec and rm act on the fork and never on the parent.
type nerdctlFork struct {
	stateDir, hostsDir string
	labels             map[string]string
	logURI             *url.URL
}

// isNerdctl tells whether labels are a nerdctl container's.
func isNerdctl(labels map[string]string) bool {
	return labels[nerdctlStateDir] != "" && labels[LabelNerdctlName] != ""
}

// prepareNerdctlFork writes fork id's nerdctl state and adjusts its spec;
// named: the id was given by the caller.
func prepareNerdctlFork(parentLabels map[string]string, spec *oci.Spec, parentID, id string, named bool) (*nerdctlFork, error) {
	pState := filepath.Clean(parentLabels[nerdctlStateDir])
	if filepath.Base(pState) != parentID {
		return nil, fmt.Errorf("nerdctl state directory %s of %s does not end in its id: %w", pState, parentID, errdefs.ErrNotImplemented)
	}
	nsDir := filepath.Dir(pState)                                // <data store>/containers/<ns>
	dataStore := filepath.Dir(filepath.Dir(nsDir))               // <data store>
	ns := filepath.Base(nsDir)                                   // <ns>
	pHosts := filepath.Join(dataStore, "etchosts", ns, parentID) // hostsstore's
	nf := &nerdctlFork{stateDir: filepath.Join(nsDir, id), hostsDir: filepath.Join(dataStore, "etchosts", ns, id)}

	name := id
	if !named {
		name = parentLabels[LabelNerdctlName] + "-" + id[strings.LastIndex(id, "-")+1:]
	}
	nf.labels = map[string]string{}
	for k, v := range parentLabels {
		if strings.HasPrefix(k, nerdctlPrefix) {
			nf.labels[k] = v
		}
	}
	nf.labels[LabelNerdctlName] = name
	nf.labels[nerdctlStateDir] = nf.stateDir
	delete(nf.labels, "nerdctl/error")
	if u := parentLabels[nerdctlLogURI]; u != "" {
		p, err := url.Parse(u)
		if err != nil {
			return nil, fmt.Errorf("nerdctl log URI %q of %s: %w", u, parentID, errdefs.ErrInvalidArgument)
		}
		nf.logURI = p
	}

	if err := os.MkdirAll(nf.stateDir, 0o700); err != nil {
		return nil, fmt.Errorf("nerdctl state of fork %s: %w", id, err)
	}
	for _, f := range nerdctlStateFiles {
		if err := copyFile(filepath.Join(pState, f), filepath.Join(nf.stateDir, f)); err != nil && !errors.Is(err, os.ErrNotExist) {
			nf.remove()
			return nil, fmt.Errorf("nerdctl state of fork %s: %w", id, err)
		}
	}
	if _, err := os.Stat(pHosts); err == nil {
		if err := os.MkdirAll(nf.hostsDir, 0o700); err != nil {
			nf.remove()
			return nil, fmt.Errorf("nerdctl /etc/hosts of fork %s: %w", id, err)
		}
		if err := copyFile(filepath.Join(pHosts, "hosts"), filepath.Join(nf.hostsDir, "hosts")); err != nil && !errors.Is(err, os.ErrNotExist) {
			nf.remove()
			return nil, fmt.Errorf("nerdctl /etc/hosts of fork %s: %w", id, err)
		}
	}

	// The fork binds its own copies, and its hooks read its own name and
	// state directory.
	for i, m := range spec.Mounts {
		switch {
		case strings.HasPrefix(m.Source, pState+"/"):
			spec.Mounts[i].Source = filepath.Join(nf.stateDir, strings.TrimPrefix(m.Source, pState+"/"))
		case strings.HasPrefix(m.Source, pHosts+"/"):
			spec.Mounts[i].Source = filepath.Join(nf.hostsDir, strings.TrimPrefix(m.Source, pHosts+"/"))
		}
	}
	for k := range spec.Annotations {
		if v, ok := nf.labels[k]; ok {
			spec.Annotations[k] = v
		}
	}
	return nf, nil
}

// io is the fork's stdio through nerdctl's logging driver (nerdctl logs), or
// nil if the parent had none.
func (nf *nerdctlFork) io() cio.Creator {
	if nf.logURI == nil {
		return nil
	}
	return cio.LogURI(nf.logURI)
}

// remove deletes what prepareNerdctlFork wrote.
func (nf *nerdctlFork) remove() {
	os.RemoveAll(nf.stateDir)
	os.RemoveAll(nf.hostsDir)
}

// removeNerdctlState deletes a nerdctl container's state directory and
// /etc/hosts and releases its name, as nerdctl rm does (its postStop hook
// releases the name too, when it has a task to stop).
func removeNerdctlState(id string, labels map[string]string) error {
	if !isNerdctl(labels) {
		return nil
	}
	st := filepath.Clean(labels[nerdctlStateDir])
	if filepath.Base(st) != id {
		return nil // not laid out as nerdctl's: leave it
	}
	nsDir := filepath.Dir(st)
	dataStore, ns := filepath.Dir(filepath.Dir(nsDir)), filepath.Base(nsDir)
	hosts := filepath.Join(dataStore, "etchosts", ns, id)
	return errors.Join(os.RemoveAll(st), os.RemoveAll(hosts),
		releaseNerdctlName(filepath.Join(dataStore, "names", ns), labels[LabelNerdctlName], id))
}

// releaseNerdctlName removes name from nerdctl's name store (a file per
// name holding the container's id, under an flock of the directory, as
// nerdctl's namestore) if id holds it.
func releaseNerdctlName(dir, name, id string) error {
	if name == "" || strings.ContainsAny(name, "/\x00") || name == "." || name == ".." {
		return nil
	}
	d, err := os.Open(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer d.Close()
	if err := unix.Flock(int(d.Fd()), unix.LOCK_EX); err != nil {
		return fmt.Errorf("lock nerdctl's names %s: %w", dir, err)
	}
	defer unix.Flock(int(d.Fd()), unix.LOCK_UN)
	p := filepath.Join(dir, name)
	b, err := os.ReadFile(p)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil || string(b) != id {
		return err // another container's name now: leave it
	}
	return os.Remove(p)
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	fi, err := in.Stat()
	if err != nil {
		return err
	}
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, fi.Mode().Perm())
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

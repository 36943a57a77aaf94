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
// /etc/hosts, as nerdctl rm does (the name goes with its postStop hook).
func removeNerdctlState(id string, labels map[string]string) error {
	if !isNerdctl(labels) {
		return nil
	}
	st := filepath.Clean(labels[nerdctlStateDir])
	if filepath.Base(st) != id {
		return nil // not laid out as nerdctl's: leave it
	}
	nsDir := filepath.Dir(st)
	hosts := filepath.Join(filepath.Dir(filepath.Dir(nsDir)), "etchosts", filepath.Base(nsDir), id)
	return errors.Join(os.RemoveAll(st), os.RemoveAll(hosts))
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

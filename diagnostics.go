package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"runtime/trace"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/labstack/echo/v4"
	"github.com/sirupsen/logrus"
)

// A drain or a boot that goes wrong explains itself. The moment it goes
// wrong — an incident — the process writes two files to
// KUMIKO_DIAGNOSTICS_DIR, named <time>-<instance>-<step>:
//
//   - .trace: the flight recorder's last seconds of execution trace
//     (go tool trace FILE), with a region for every boot phase, drain step,
//     release hook, background component and API request;
//   - .goroutines.txt: every goroutine's stack with its pprof labels
//     (phase=, step=, component=, route=), taken while the step that went
//     wrong was still stuck (diagnostics_stacks.go).
//
// The exit line names the files and the reasons, and a one-paragraph summary
// goes to the termination message, which Kubernetes shows in kubectl
// describe pod. The incidents: the drain force-closes requests or event
// streams, a release hook fails or overruns its share, the shutdown budget
// is spent, a second signal forces the exit, a background goroutine panics,
// a boot phase times out. A clean drain writes nothing. The exit code keeps
// its own policy: a force-closed request still exits 0.
//
// The recorder runs for the whole life of the process, from phase 2 until
// after the exit line; the runtime allows one per process.
type diagnostics struct {
	dir      string
	instance string
	log      *logrus.Entry

	mu        sync.Mutex            // one snapshot at a time: the recorder's WriteTo and Stop must not overlap
	recorder  *trace.FlightRecorder // nil: off, or it could not start
	incidents []incident
}

// incident is one thing that went wrong, and the files that explain it.
type incident struct {
	reason     string
	trace      string // the files' paths; "" when not written
	goroutines string
}

// startDiagnostics starts the flight recorder (KUMIKO_FLIGHT_RECORDER) and
// checks that the directory takes files: that is better learnt at boot than
// when something has gone wrong. Either failure is returned for phase 2 to
// warn about; the diagnostics work without the recorder, or without files.
func startDiagnostics(c diagnosticsConfig, instance string, log *logrus.Logger) (*diagnostics, error) {
	d := &diagnostics{dir: c.Dir, instance: instance, log: componentDiagnostics.log(log)}
	if d.dir == "" {
		d.dir = filepath.Join(os.TempDir(), serviceName+"-diagnostics")
	}
	var errs []error
	if err := checkWritable(d.dir); err != nil {
		errs = append(errs, fmt.Errorf("KUMIKO_DIAGNOSTICS_DIR: %w", err))
	}
	if c.FlightRecorder {
		fr := trace.NewFlightRecorder(trace.FlightRecorderConfig{MinAge: c.RecorderWindow, MaxBytes: uint64(c.RecorderMaxMB) << 20})
		if err := fr.Start(); err != nil {
			errs = append(errs, fmt.Errorf("flight recorder: %w", err))
		} else {
			d.recorder = fr
		}
	}
	return d, errors.Join(errs...)
}

func checkWritable(dir string) error {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return err
	}
	f, err := os.CreateTemp(dir, ".probe-*")
	if err != nil {
		return err
	}
	f.Close()
	return os.Remove(f.Name())
}

// stop ends the recorder once a snapshot being written is done: the last
// thing the process does.
func (d *diagnostics) stop() {
	if d == nil {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.recorder != nil {
		d.recorder.Stop()
		d.recorder = nil
	}
}

// record writes the files of an incident and keeps it for the exit line and
// the termination message. stacks should be the look watchGoroutines took
// while the step was still stuck; without one, the goroutines are dumped now.
// name is the files' last part: the step, hook or phase, or what happened.
// Past maxIncidentFiles only the reason is kept: a drain whose every hook
// fails against one hung dependency needs its first files, not ten more.
func (d *diagnostics) record(ctx context.Context, name, reason string, stacks goroutineDump) {
	if d == nil {
		return // phase 1 failed: nothing runs that could explain more
	}
	trace.Log(ctx, "incident", reason) // marks the moment in the trace written below
	d.mu.Lock()
	defer d.mu.Unlock()
	inc := incident{reason: reason}
	entry := d.log.WithField("reason", reason)
	if len(d.incidents) < maxIncidentFiles {
		var err error
		inc.trace, inc.goroutines, err = d.write(name, reason, stacks)
		entry = entry.WithFields(logrus.Fields{"trace": inc.trace, "goroutines": inc.goroutines})
		if err != nil {
			entry = entry.WithError(err)
		}
	}
	d.incidents = append(d.incidents, inc)
	entry.Warn("diagnostics written")
}

// snapshot writes the files now, on demand (POST /admin/diagnostics): no
// incident, so the exit line and the termination message say nothing of it.
func (d *diagnostics) snapshot() (tracePath, goroutinesPath string, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.write("snapshot", "snapshot on demand", goroutineDump{})
}

// write writes an incident's two files within diagnosticsWrite, then drops
// the oldest files past keepDiagnosticFiles, so a container restarting in a
// loop cannot fill its volume. d.mu is held.
func (d *diagnostics) write(name, reason string, stacks goroutineDump) (tracePath, goroutinesPath string, err error) {
	now := time.Now().UTC()
	base := filepath.Join(d.dir, fileSafe(fmt.Sprintf("%s-%s-%s", now.Format("20060102T150405.000Z"), d.instance, name)))
	deadline := now.Add(diagnosticsWrite)
	var errs []error
	if d.recorder != nil {
		path := base + traceSuffix
		if err := writeFile(path, deadline, func(w io.Writer) error { _, err := d.recorder.WriteTo(w); return err }); err != nil {
			errs = append(errs, fmt.Errorf("writing the trace: %w", err))
		} else {
			tracePath = path
		}
	}
	if stacks.at.IsZero() {
		stacks = takeGoroutines()
	}
	path := base + goroutinesSuffix
	if err := writeFile(path, deadline, func(w io.Writer) error {
		_, err := fmt.Fprintf(w, "# %s %s: %s\n# goroutines as of %s, with their pprof labels\n\n%s",
			serviceName, d.instance, reason, stacks.at.UTC().Format(time.RFC3339Nano), stacks.text)
		return err
	}); err != nil {
		errs = append(errs, fmt.Errorf("writing the goroutines: %w", err))
	} else {
		goroutinesPath = path
	}
	if err := d.prune(); err != nil {
		errs = append(errs, err)
	}
	return tracePath, goroutinesPath, errors.Join(errs...)
}

const (
	traceSuffix      = ".trace"
	goroutinesSuffix = ".goroutines.txt"

	// maxIncidentFiles: the incidents of one process that get files.
	maxIncidentFiles = 4
	// keepDiagnosticFiles: the files the directory keeps, newest first, so
	// its size is bounded (about 8 × the recorder's size) however often
	// a container restarts in place.
	keepDiagnosticFiles = 16
)

// writeFile creates path and fills it, giving up at deadline; a file it
// could not finish is removed.
func writeFile(path string, deadline time.Time, fill func(io.Writer) error) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o640)
	if err != nil {
		return err
	}
	err = errors.Join(fill(deadlineWriter{w: f, deadline: deadline}), f.Close())
	if err != nil {
		os.Remove(path)
	}
	return err
}

// deadlineWriter fails every write after its deadline: a snapshot may take
// its share of the drain, not the drain.
type deadlineWriter struct {
	w        io.Writer
	deadline time.Time
}

func (w deadlineWriter) Write(p []byte) (int, error) {
	if time.Now().After(w.deadline) {
		return 0, fmt.Errorf("not written within %s", diagnosticsWrite)
	}
	return w.w.Write(p)
}

// fileSafe keeps a file name to letters, digits and ._- (an instance id may
// hold anything).
func fileSafe(s string) string {
	return strings.Map(func(r rune) rune {
		if r < utf8.RuneSelf && (r == '.' || r == '_' || r == '-' || r >= '0' && r <= '9' || r >= 'A' && r <= 'Z' || r >= 'a' && r <= 'z') {
			return r
		}
		return '_'
	}, s)
}

// diagnosticFile is one file of the directory, as GET /admin/diagnostics lists it.
type diagnosticFile struct {
	Name     string    `json:"name"`
	Bytes    int64     `json:"bytes"`
	Modified time.Time `json:"modified"`
}

// files lists the diagnostics' files in the directory, newest first. Their
// names begin with the time they were written, so names sort by age.
func (d *diagnostics) files() ([]diagnosticFile, error) {
	entries, err := os.ReadDir(d.dir)
	if err != nil {
		return nil, err
	}
	var files []diagnosticFile
	for _, e := range entries {
		if !e.Type().IsRegular() || !isDiagnosticFile(e.Name()) {
			continue
		}
		info, err := e.Info()
		if err != nil {
			continue // removed meanwhile
		}
		files = append(files, diagnosticFile{Name: e.Name(), Bytes: info.Size(), Modified: info.ModTime().UTC()})
	}
	slices.SortFunc(files, func(a, b diagnosticFile) int { return strings.Compare(b.Name, a.Name) })
	return files, nil
}

func isDiagnosticFile(name string) bool {
	return !strings.HasPrefix(name, ".") && (strings.HasSuffix(name, traceSuffix) || strings.HasSuffix(name, goroutinesSuffix))
}

// prune keeps the newest keepDiagnosticFiles files.
func (d *diagnostics) prune() error {
	files, err := d.files()
	if err != nil {
		return err
	}
	var errs []error
	for _, f := range files[min(len(files), keepDiagnosticFiles):] {
		if err := os.Remove(filepath.Join(d.dir, f.Name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// recorded is a copy of the incidents so far.
func (d *diagnostics) recorded() []incident {
	if d == nil {
		return nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.incidents)
}

// exitFields are the exit line's fields for the incidents: every reason,
// " | " between two, and the files of the first, which the later ones
// usually follow from (each has its own "diagnostics written" line).
func exitFields(incidents []incident) logrus.Fields {
	if len(incidents) == 0 {
		return nil
	}
	reasons := make([]string, len(incidents))
	for i, inc := range incidents {
		reasons[i] = inc.reason
	}
	fields := logrus.Fields{"diagnostics": strings.Join(reasons, " | ")}
	for name, path := range map[string]string{"trace": incidents[0].trace, "goroutines": incidents[0].goroutines} {
		if path != "" {
			fields[name] = path
		}
	}
	return fields
}

// ---------------------------------------------------------------------------
// The termination message

// terminationLogPath is where the termination message goes: the configured
// file, else Kubernetes' default /dev/termination-log where it exists (the
// kubelet creates it for each container), else nowhere.
func terminationLogPath(configured string) string {
	if configured != "" {
		return configured
	}
	if _, err := os.Stat("/dev/termination-log"); err == nil {
		return "/dev/termination-log"
	}
	return ""
}

// terminationMessage is one paragraph for Kubernetes to keep as the
// container's last state (kubectl describe pod): when and why the process
// exited, what went wrong, and where the files are. At most
// maxTerminationMessage bytes, all the kubelet reads.
func terminationMessage(instance string, at time.Time, code int, stopReason string, err error, incidents []incident) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s exited %d at %s", serviceName, instance, code, at.UTC().Format(time.RFC3339))
	if stopReason != "" {
		fmt.Fprintf(&b, " (stop: %s)", stopReason)
	}
	if err != nil {
		fmt.Fprintf(&b, ": %s", strings.ReplaceAll(err.Error(), "\n", "; "))
	}
	b.WriteString(".")
	for i, inc := range incidents {
		fmt.Fprintf(&b, " %d) %s.", i+1, inc.reason)
		var files []string
		for _, f := range []string{inc.trace, inc.goroutines} {
			if f != "" {
				files = append(files, f)
			}
		}
		if len(files) > 0 {
			fmt.Fprintf(&b, " Files: %s.", strings.Join(files, ", "))
		}
	}
	if len(incidents) > 0 {
		b.WriteString(" GET /admin/diagnostics on the ops port lists and serves them; go tool trace opens a .trace.")
	}
	msg := b.String()
	if len(msg) > maxTerminationMessage {
		cut := maxTerminationMessage - len("…")
		for cut > 0 && !utf8.RuneStart(msg[cut]) {
			cut--
		}
		msg = msg[:cut] + "…"
	}
	return msg
}

// maxTerminationMessage is the most of a termination message the kubelet reads.
const maxTerminationMessage = 4096

// ---------------------------------------------------------------------------
// On demand: GET and POST /admin/diagnostics

// addDiagnosticsRoutes serves the diagnostics behind the admin token. POST
// writes a snapshot now, for a slow request someone wants to understand
// while it is slow; GET lists the files, a previous container's included (a
// restart in place keeps the emptyDir); GET /admin/diagnostics/<name> serves
// one, since the image has no shell to kubectl cp them with.
func addDiagnosticsRoutes(g *echo.Group, d *diagnostics) {
	g.POST("/diagnostics", func(c echo.Context) error {
		tracePath, goroutinesPath, err := d.snapshot()
		if tracePath == "" && goroutinesPath == "" {
			d.log.WithError(err).Warn("snapshot on demand failed")
			return apiError(http.StatusInternalServerError, "snapshot_failed", "the snapshot could not be written; the log says why")
		}
		if err != nil {
			d.log.WithError(err).Warn("snapshot on demand incomplete")
		}
		return c.JSON(http.StatusCreated, map[string]string{"trace": nameOf(tracePath), "goroutines": nameOf(goroutinesPath)})
	})
	g.Match(getHead(), "/diagnostics", func(c echo.Context) error {
		files, err := d.files()
		if err != nil {
			return err
		}
		return c.JSON(http.StatusOK, map[string]any{"dir": d.dir, "recorder": d.recording(), "files": files})
	})
	g.Match(getHead(), "/diagnostics/:name", func(c echo.Context) error {
		name := c.Param("name")
		if name != filepath.Base(name) || !isDiagnosticFile(name) {
			return apiError(http.StatusNotFound, "not_found", "no such diagnostics file")
		}
		path := filepath.Join(d.dir, name)
		if _, err := os.Stat(path); err != nil {
			return apiError(http.StatusNotFound, "not_found", "no such diagnostics file")
		}
		return c.Attachment(path, name)
	})
}

// count is "1 request", "2 requests".
func count(n int64, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// nameOf is a written file's name, "" for none.
func nameOf(path string) string {
	if path == "" {
		return ""
	}
	return filepath.Base(path)
}

// recording reports whether the flight recorder runs.
func (d *diagnostics) recording() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.recorder != nil
}

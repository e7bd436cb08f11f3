package main

import (
	"context"
	"runtime/pprof"
	"runtime/trace"

	"github.com/labstack/echo/v4"
)

// Every boot phase, drain step, release hook, background component and API
// request is named twice: by a pprof label on its goroutines, which a
// goroutine dump shows (the diagnostics' dumps, /debug/pprof/goroutine?debug=1),
// and by an execution-trace region, which the flight recorder's trace shows
// (a trace carries no pprof labels). One label key for each kind:
//
//	phase=<name>         a boot phase
//	step=<name>          a drain step or a release hook, named as in its log line
//	component=<name>     a background component, a listener and its connections
//	route=<METHOD path>  an API request, by its route template
//
// A goroutine keeps the labels of the goroutine that started it, for life,
// so a long-lived one is labelled where it starts (startStop, retry,
// listenHTTP) rather than with the phase it happened to start in: the
// contexts carry only the labels the process was started with (none in
// production, a test's marker in-process), never a phase's or a step's.
const (
	labelPhase     = "phase"
	labelStep      = "step"
	labelComponent = "component"
	labelRoute     = "route"
)

// labelled runs fn with this goroutine labelled key=value on top of ctx's
// labels, in a trace region "key value", and gives the goroutine ctx's
// labels back afterwards. Goroutines fn starts keep the label.
func labelled(ctx context.Context, key, value string, fn func()) {
	defer pprof.SetGoroutineLabels(ctx)
	pprof.SetGoroutineLabels(withLabel(ctx, key, value))
	trace.WithRegion(ctx, key+" "+value, fn)
}

// withLabel is ctx carrying the pprof label key=value too.
func withLabel(ctx context.Context, key, value string) context.Context {
	return pprof.WithLabels(ctx, pprof.Labels(key, value))
}

// withLabelsOf is dst carrying src's pprof labels.
func withLabelsOf(dst, src context.Context) context.Context {
	var kv []string
	pprof.ForLabels(src, func(k, v string) bool {
		kv = append(kv, k, v)
		return true
	})
	return pprof.WithLabels(dst, pprof.Labels(kv...))
}

// labelRequests names an API request by its route: pprof label route=…, in a
// trace region of the same name, so a request still running when the drain
// force-closes it is named in the dump and the trace. The request's context
// carries its listener's labels (listenHTTP), which its goroutine gets back
// afterwards. It costs a request about a microsecond and six small
// allocations (BenchmarkLabelRequests), a fraction of a percent of an
// order's CPU, so it is on with or without the flight recorder; without
// one, the region costs nothing.
func labelRequests() echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			route := c.Request().Method + " " + c.Path()
			var err error
			labelled(c.Request().Context(), labelRoute, route, func() { err = next(c) })
			return err
		}
	}
}

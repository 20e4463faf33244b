//! The trace over time: every second the session reads the running counts
//! ([`super::Running`]) of the whole tree, and the recorder turns them into
//! the profile's [`Timeline`] (what happened in each interval). A long
//! trace keeps at most [`Timeline::MAX_POINTS`] points: when full,
//! neighbours are joined and the interval doubles, so memory stays bounded
//! whatever the duration.

use crate::profile::{TimePoint, Timeline};

use super::Running;

/// Turns cumulative counts read at increasing times into a [`Timeline`].
#[derive(Clone, Debug)]
pub struct Recorder {
    timeline: Timeline,
    /// The counts at the end of the last point.
    last: Running,
    last_t: f64,
    frees_counted: bool,
}

impl Recorder {
    /// A recorder whose points cover `interval_secs` each at first.
    pub fn new(interval_secs: f64, frees_counted: bool) -> Self {
        Recorder {
            timeline: Timeline {
                interval_secs,
                points: Vec::new(),
            },
            last: Running::default(),
            last_t: 0.0,
            frees_counted,
        }
    }

    /// The counts so far, `t` seconds after tracing began; a point is
    /// added when the current interval is over (or, with `end`, at the
    /// end of the trace, for whatever time is left).
    pub fn record(&mut self, t: f64, now: Running, live_bytes: Option<u64>, end: bool) {
        let interval = self.timeline.interval_secs;
        // Ticks come about a second apart, a little late or early.
        if !end && t - self.last_t < interval * 0.95 {
            return;
        }
        if end && t <= self.last_t {
            return;
        }
        // Counts never go back, but a process whose probes were detached
        // before its profile was kept could make them: never underflow.
        let point = TimePoint {
            t,
            calls: now.calls.saturating_sub(self.last.calls),
            bytes: now.bytes.saturating_sub(self.last.bytes),
            frees: self
                .frees_counted
                .then(|| now.frees.saturating_sub(self.last.frees)),
            live_bytes,
        };
        self.last = now;
        self.last_t = t;
        self.timeline.points.push(point);
        if self.timeline.points.len() > Timeline::MAX_POINTS {
            self.halve();
        }
    }

    /// Joins neighbouring points: half as many, each twice as long.
    fn halve(&mut self) {
        let points = std::mem::take(&mut self.timeline.points);
        for pair in points.chunks(2) {
            let mut p = *pair.last().unwrap();
            if pair.len() == 2 {
                p.calls += pair[0].calls;
                p.bytes += pair[0].bytes;
                p.frees = match (pair[0].frees, p.frees) {
                    (Some(a), Some(b)) => Some(a + b),
                    (a, b) => a.or(b),
                };
            }
            self.timeline.points.push(p);
        }
        self.timeline.interval_secs *= 2.0;
    }

    pub fn timeline(&self) -> &Timeline {
        &self.timeline
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(calls: u64) -> Running {
        Running {
            calls,
            bytes: calls * 10,
            frees: calls / 2,
            lost: 0,
        }
    }

    #[test]
    fn points_hold_what_happened_in_their_interval() {
        let mut r = Recorder::new(1.0, true);
        r.record(1.0, at(100), None, false);
        r.record(1.5, at(120), None, false); // too soon: no point
        r.record(2.01, at(250), Some(7), false);
        r.record(2.5, at(300), None, true);
        let pts = &r.timeline().points;
        assert_eq!(pts.len(), 3);
        assert_eq!(
            (pts[0].calls, pts[0].bytes, pts[0].frees),
            (100, 1000, Some(50))
        );
        assert_eq!((pts[1].calls, pts[1].live_bytes), (150, Some(7)));
        assert_eq!((pts[2].t, pts[2].calls), (2.5, 50));
        let sum: u64 = pts.iter().map(|p| p.calls).sum();
        assert_eq!(sum, 300);
    }

    #[test]
    fn frees_are_absent_when_not_counted() {
        let mut r = Recorder::new(1.0, false);
        r.record(1.0, at(10), None, false);
        assert_eq!(r.timeline().points[0].frees, None);
    }

    #[test]
    fn a_long_trace_stays_bounded_and_keeps_every_call() {
        for n in [
            Timeline::MAX_POINTS as u64 + 100,
            5 * Timeline::MAX_POINTS as u64,
        ] {
            let mut r = Recorder::new(1.0, true);
            for i in 1..n {
                r.record(i as f64, at(i * 3), None, false);
            }
            r.record(n as f64, at(n * 3), None, true);
            let tl = r.timeline();
            assert!(tl.points.len() <= Timeline::MAX_POINTS);
            // The interval doubles as often as the points would overflow.
            let expected_interval =
                2f64.powf((n as f64 / Timeline::MAX_POINTS as f64).log2().ceil());
            assert_eq!(tl.interval_secs, expected_interval, "{n} s");
            assert_eq!(tl.points.iter().map(|p| p.calls).sum::<u64>(), n * 3);
            assert_eq!(tl.points.last().unwrap().t, n as f64);
            // Every point but the last covers the interval it was made in.
            assert!(tl.points.windows(2).all(|w| w[1].t > w[0].t));
        }
    }
}

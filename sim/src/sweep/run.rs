//! Running many independent jobs on a bounded number of threads, in the order given.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use indicatif::ProgressBar;

/// The most threads a sweep starts, whatever the machine says.
pub const MAX_JOBS: usize = 64;

/// The threads to use by default: the cores available, at least 1, at most [`MAX_JOBS`].
pub fn default_jobs() -> usize {
    std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .clamp(1, MAX_JOBS)
}

/// Why a job failed: its index and error, or a panic in it.
#[derive(Debug)]
pub enum JobFailure<E> {
    /// Job `index` returned `error` (the failure of lowest index when several failed).
    Failed {
        /// The job's index in the input.
        index: usize,
        /// What it returned.
        error: E,
    },
    /// A job panicked.
    Panicked {
        /// The panic message, when it was a string.
        message: String,
    },
}

/// Runs `f` on every item on up to `jobs` threads (at least 1, at most [`MAX_JOBS`] and the
/// number of items), ticking `progress` once per finished item, and keeps every result: one
/// slot per item, in order, `None` for an item that never started because a job failed or
/// `stop` said so (it is asked before each item). After a failure no new item starts.
///
/// # Errors
/// A panic in `f`.
pub fn parallel_slots<T, R, E>(
    items: &[T],
    jobs: usize,
    progress: &ProgressBar,
    stop: &(dyn Fn() -> bool + Sync),
    f: impl Fn(&T) -> Result<R, E> + Sync,
) -> Result<Vec<Option<Result<R, E>>>, JobFailure<E>>
where
    T: Sync,
    R: Send,
    E: Send,
{
    let threads = jobs.clamp(1, MAX_JOBS).min(items.len().max(1));
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let slots: Mutex<Vec<Option<Result<R, E>>>> =
        Mutex::new(std::iter::repeat_with(|| None).take(items.len()).collect());
    let panicked = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| loop {
                    if failed.load(Ordering::Relaxed) || stop() {
                        break;
                    }
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(item) = items.get(i) else { break };
                    let out = f(item);
                    if out.is_err() {
                        failed.store(true, Ordering::Relaxed);
                    }
                    if let Ok(mut s) = slots.lock() {
                        if let Some(slot) = s.get_mut(i) {
                            *slot = Some(out);
                        }
                    }
                    progress.inc(1);
                })
            })
            .collect();
        let mut panicked = None;
        for h in handles {
            if let Err(p) = h.join() {
                let message = p
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a job panicked".to_owned());
                panicked.get_or_insert(message);
            }
        }
        panicked
    });
    if let Some(message) = panicked {
        return Err(JobFailure::Panicked { message });
    }
    // A poisoned lock means a job panicked while holding it, reported above.
    Ok(slots.into_inner().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`parallel_slots`] as a map: the results in the items' order, or the failure of lowest
    /// index (the behaviour the tests pin down).
    ///
    /// # Errors
    /// The failure of lowest index, or a panic in `f`.
    fn parallel_map<T, R, E>(
        items: &[T],
        jobs: usize,
        progress: &ProgressBar,
        f: impl Fn(&T) -> Result<R, E> + Sync,
    ) -> Result<Vec<R>, JobFailure<E>>
    where
        T: Sync,
        R: Send,
        E: Send,
    {
        let slots = parallel_slots(items, jobs, progress, &|| false, f)?;
        let mut out = Vec::with_capacity(items.len());
        let mut missing = false;
        for (index, slot) in slots.into_iter().enumerate() {
            match slot {
                Some(Ok(r)) => out.push(r),
                Some(Err(error)) => return Err(JobFailure::Failed { index, error }),
                None => missing = true,
            }
        }
        // Items are skipped only after a failure, which returned above.
        if missing {
            return Err(JobFailure::Panicked {
                message: "a job ended without a result".into(),
            });
        }
        Ok(out)
    }

    #[test]
    fn results_come_back_in_order_and_progress_counts_them() {
        let items: Vec<u32> = (0..50).collect();
        let pb = ProgressBar::hidden();
        pb.set_length(50);
        let out = parallel_map(&items, 4, &pb, |i| Ok::<_, ()>(i * 2)).unwrap();
        assert_eq!(out, items.iter().map(|i| i * 2).collect::<Vec<_>>());
        assert_eq!(pb.position(), 50);
        assert!(parallel_map(&[] as &[u32], 4, &pb, |i| Ok::<_, ()>(*i))
            .unwrap()
            .is_empty());
    }

    #[test]
    fn the_lowest_failure_is_reported_and_panics_are_caught() {
        let items: Vec<u32> = (0..10).collect();
        let pb = ProgressBar::hidden();
        // One thread: items run in order, so item 3 fails first and 7 never runs.
        match parallel_map(&items, 1, &pb, |i| {
            if *i == 3 || *i == 7 {
                Err(*i)
            } else {
                Ok(*i)
            }
        }) {
            Err(JobFailure::Failed { index, error }) => assert_eq!((index, error), (3, 3)),
            other => panic!("{other:?}"),
        }
        let r = parallel_map(&items, 2, &pb, |i| {
            if *i == 5 {
                panic!("cell {i} broke");
            }
            Ok::<_, ()>(*i)
        });
        match r {
            Err(JobFailure::Panicked { message }) => assert_eq!(message, "cell 5 broke"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_stop_keeps_what_finished_and_starts_nothing_new() {
        let items: Vec<u32> = (0..10).collect();
        let done = AtomicUsize::new(0);
        // One thread: items run in order; the stop is seen before item 4 starts.
        let slots = parallel_slots(
            &items,
            1,
            &ProgressBar::hidden(),
            &|| done.load(Ordering::Relaxed) >= 4,
            |i| {
                done.fetch_add(1, Ordering::Relaxed);
                Ok::<_, ()>(*i)
            },
        )
        .unwrap();
        let kept: Vec<Option<u32>> = slots.into_iter().map(|s| s.map(Result::unwrap)).collect();
        assert_eq!(
            kept,
            [
                Some(0),
                Some(1),
                Some(2),
                Some(3),
                None,
                None,
                None,
                None,
                None,
                None
            ]
        );
    }

    #[test]
    fn default_jobs_is_bounded() {
        let j = default_jobs();
        assert!((1..=MAX_JOBS).contains(&j));
    }
}

//! `--user USER`: who the command of launch mode runs as. Looked up before
//! the fork (the passwd and group databases may need NSS, which a forked
//! child of a threaded process must not call); the child only makes the
//! system calls.

use std::ffi::{CString, OsString};

use anyhow::Result;
use nix::unistd::{getgrouplist, User};

use crate::error::{UserError, EXIT_USAGE};

/// The credentials and environment the command gets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunAs {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups, as `initgroups` would set them.
    pub groups: Vec<u32>,
    pub home: OsString,
}

impl RunAs {
    /// `user` by name, or by numeric uid if no user has that name; an
    /// unknown user is a usage error.
    pub fn lookup(user: &str) -> Result<RunAs> {
        let by_name = User::from_name(user).map_err(|e| fail(user, e))?;
        let found = match (by_name, user.parse::<u32>()) {
            (Some(u), _) => Some(u),
            (None, Ok(uid)) => User::from_uid(uid.into()).map_err(|e| fail(user, e))?,
            (None, Err(_)) => None,
        };
        let Some(u) = found else {
            return Err(anyhow::Error::new(UserError::with_code(
                format!("--user {user}: no such user"),
                EXIT_USAGE,
            )));
        };
        let cname = CString::new(u.name.as_bytes())?;
        let groups = getgrouplist(&cname, u.gid)
            .map_err(|e| fail(user, e))?
            .into_iter()
            .map(|g| g.as_raw())
            .collect();
        Ok(RunAs {
            name: u.name,
            uid: u.uid.as_raw(),
            gid: u.gid.as_raw(),
            groups,
            home: u.dir.into_os_string(),
        })
    }

    /// The environment the command starts with: mtrace's own, with HOME,
    /// USER and LOGNAME those of the user, as `sudo -u` sets them.
    pub fn environment(&self) -> Vec<(OsString, OsString)> {
        let set: [(&str, OsString); 3] = [
            ("HOME", self.home.clone()),
            ("USER", self.name.clone().into()),
            ("LOGNAME", self.name.clone().into()),
        ];
        let mut env: Vec<(OsString, OsString)> = std::env::vars_os()
            .filter(|(k, _)| !set.iter().any(|(name, _)| k == name))
            .collect();
        env.extend(set.into_iter().map(|(k, v)| (k.into(), v)));
        env
    }
}

fn fail(user: &str, e: nix::Error) -> anyhow::Error {
    anyhow::anyhow!("--user {user}: cannot read the user database: {e}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_by_name_and_by_uid() {
        let root = RunAs::lookup("root").unwrap();
        assert_eq!((root.uid, root.gid), (0, 0));
        assert!(root.groups.contains(&0), "{:?}", root.groups);
        assert_eq!(RunAs::lookup("0").unwrap(), root);
    }

    #[test]
    fn an_unknown_user_is_a_usage_error() {
        let e = RunAs::lookup("no-such-user-mtrace").unwrap_err();
        let u = e.downcast_ref::<UserError>().unwrap();
        assert_eq!(u.code, EXIT_USAGE);
        assert_eq!(u.message, "--user no-such-user-mtrace: no such user");
    }

    #[test]
    fn the_environment_names_the_user() {
        let r = RunAs {
            name: "alice".into(),
            uid: 1000,
            gid: 1000,
            groups: vec![1000],
            home: "/home/alice".into(),
        };
        let env = r.environment();
        let get = |k: &str| {
            let v: Vec<_> = env.iter().filter(|(n, _)| n == k).collect();
            assert_eq!(v.len(), 1, "{k} set {} times", v.len());
            v[0].1.clone()
        };
        assert_eq!(get("HOME"), "/home/alice");
        assert_eq!(get("USER"), "alice");
        assert_eq!(get("LOGNAME"), "alice");
    }
}
